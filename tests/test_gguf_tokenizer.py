"""Tokenizers built from GGUF metadata agree with transformers' GGUF tokenizer conversion, token for token."""
import pytest

from shards.tokenizer import Tokenizer
from tests.gguf_util import GGUF_MODELS, fixture, gguf_golden, smollm2_path

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
