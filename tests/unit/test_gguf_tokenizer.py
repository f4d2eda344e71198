"""Tokenizers built from GGUF metadata agree with transformers' GGUF tokenizer conversion, token for token."""

import pytest
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HF

from shards.formats.gguf_tokenizer import PRE_TOKENIZERS
from shards.formats.tokenizer import Tokenizer
from tests.support.gguf_util import GGUF_MODELS, fixture, gguf_golden, smollm2_path

CASES = [(name, fixture(name), gguf_golden()["models"][name]["tokenizer"]) for name in GGUF_MODELS] + [
    ("spm", fixture("spm"), gguf_golden()["spm"]["tokenizer"]),
    ("smollm2", None, gguf_golden()["smollm2"]["tokenizer"]),
]


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def case(request):
    name, path, golden = request.param
    return Tokenizer.load(path or smollm2_path()), golden


def test_encode_matches_transformers(case):
    tok, g = case
    assert [tok.encode(c["text"], add_special_tokens=False) for c in g["encode"]] == [c["ids"] for c in g["encode"]]


def test_bos_is_added_exactly_when_the_file_says_so(case):
    tok, g = case
    assert [tok.encode(c["text"]) for c in g["encode_with_specials"]] == [c["ids"] for c in g["encode_with_specials"]]


def test_decode_matches_transformers(case):
    tok, g = case
    assert [tok.decode(c["ids"], skip_special_tokens=False) for c in g["decode"]] == [c["text"] for c in g["decode"]]


def test_chat_prompt_ids_match_transformers(case):
    tok, g = case
    assert tok.render_chat(g["chat"]["messages"]) == g["chat"]["text"]
    assert tok.encode_chat(g["chat"]["messages"]) == g["chat"]["ids"]


def test_smollm2_varied_texts_are_all_covered():
    texts = [c["text"] for c in gguf_golden()["smollm2"]["tokenizer"]["encode"]]
    for needle in ["é", "😀", "def ", "2024", "   ", "\t", "日本", "<|im_start|>"]:
        assert any(needle in t for t in texts), needle


def test_smollm2_special_tokens_are_never_split_and_stop_generation():
    tok = Tokenizer.load(smollm2_path())
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False) == [1, 4093, 2]
    assert tok.eos_token_ids == {2} and tok.eos_token == "<|im_end|>"
    assert tok.decode([1, 4093, 2]) == "user"  # specials skipped by default
    assert "You are a helpful AI assistant named SmolLM" in tok.render_chat([{"role": "user", "content": "hi"}])


def test_user_defined_tokens_stay_whole_but_are_not_special():
    tok = Tokenizer.load(fixture("spm"))
    ids = tok.encode("a <tool> b", add_special_tokens=False)
    assert tok.hf.token_to_id("<tool>") in ids
    assert tok.decode(ids) == "a <tool> b"


def test_pre_tokenizer_splits_follow_llama_cpp_per_tokenizer_ggml_pre():
    # what the merges were learned on: SmolLM2 ('smollm') isolates every digit, Llama 3 groups up to three, Qwen2
    # isolates digits and attaches a leading non-letter to words, GPT-2 keeps digit runs with their space
    def pieces(pre: str, text: str) -> list[str]:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre].regexes]
        tok = HF(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
        return [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]

    assert pieces("smollm", "in 2024!") == ["in", " ", "2", "0", "2", "4", "!"]
    assert pieces("llama-bpe", "in 2024!") == ["in", " ", "202", "4", "!"]
    assert pieces("qwen2", "in 2024,x") == ["in", " ", "2", "0", "2", "4", ",x"]
    assert pieces("gpt-2", "in 2024!") == ["in", " 2024", "!"]
    assert PRE_TOKENIZERS["llama-bpe"].ignore_merges and not PRE_TOKENIZERS["smollm"].ignore_merges
    assert Tokenizer.load(smollm2_path()).encode("2024", add_special_tokens=False) == [34, 32, 34, 36]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_metadata_reads_as_the_gguf_reader_gives_it_long_arrays_packed_or_not(name):
    """Long arrays (a vocabulary's tokens, scores, types, merges) are held packed, not as Python objects; every key
    still reads as gguf's own reader gives it, item for item and type for type."""
    import gguf

    from shards.formats.gguf_file import _Packed, open_gguf

    path = fixture(name) if name != "smollm2" else smollm2_path()
    f, reader = open_gguf(path), gguf.GGUFReader(path)
    assert any(isinstance(value, _Packed) for _, value in f.meta.values())
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own fields: not metadata
            continue
        kinds = set(field.types)  # whatever the key holds, asked for as what it is
        got, want = f.get(key, kinds, "it"), field.contents()
        assert got == want and [type(x) for x in _items(got)] == [type(x) for x in _items(want)], key


def _items(value):
    return value if isinstance(value, list) else [value]
