"""Tokenizer, chat template and streaming detokenization against transformers' outputs."""

import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.formats.tokenizer import Tokenizer, TokenizerError
from tests.conftest import FIXTURES, golden


def test_chat_template_matches_transformers(model_dir, model):
    # llama/qwen3 keep the template in tokenizer_config.json, qwen2 in chat_template.jinja
    chat = golden(model)["chat"]
    tok = Tokenizer(model_dir)
    assert tok.render_chat(chat["messages"]) == chat["text"]
    assert tok.encode_chat(chat["messages"]) == chat["ids"]


def test_without_generation_prompt():
    tok = Tokenizer(FIXTURES / "llama")
    text = tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert text.endswith("<|im_end|>\n") and "assistant" not in text


def test_decode_matches_transformers(model_dir, model):
    tok = Tokenizer(model_dir)
    for case in golden(model)["decode_cases"]:
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]
        if case["from_encode"]:
            assert tok.encode(case["text"], add_special_tokens=False) == case["ids"]


def test_eos_ids_merge_config_generation_config_and_tokenizer(model_dir, model):
    assert Tokenizer(model_dir).eos_token_ids == {509, 511}  # generation_config lists both


def test_streaming_never_splits_a_character_and_adds_up_to_the_whole():
    tok = Tokenizer(FIXTURES / "llama")
    text = "A naïve café in Zürich: 日本 😀 🎉 done."
    ids = tok.encode(text, add_special_tokens=False)
    stream = tok.stream()
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces[:-1])  # some tokens held back half a character


def test_streaming_skips_special_tokens_and_flushes_broken_bytes():
    tok = Tokenizer(FIXTURES / "llama")
    stream = tok.stream()
    assert stream.push(508) == ""  # <|begin_of_text|> is special
    hi = tok.encode("Hi", add_special_tokens=False)
    assert "".join(stream.push(t) for t in hi) == "Hi"
    assert stream.push(162) == ""  # first byte of a 3-byte character: held back
    assert stream.flush() == "\ufffd"  # the stream ended mid-character


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer(tmp_path)
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama", d)
    (d / "tokenizer_config.json").write_text("[")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer(d)


def test_template_errors_are_clear(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "qwen2", d)
    (d / "chat_template.jinja").write_text("{{ raise_exception('only user turns') }}")
    with pytest.raises(TokenizerError, match="only user turns"):
        Tokenizer(d).encode_chat([{"role": "user", "content": "x"}])
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content.__class__.__mro__[1].__subclasses__() }}{% endfor %}"
    )
    with pytest.raises(TokenizerError, match="unsafe"):  # templates come with downloaded models: sandboxed
        Tokenizer(d).render_chat([{"role": "user", "content": "x"}])
    (d / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(TokenizerError, match="chat template failed"):
        Tokenizer(d).render_chat([{"role": "user", "content": "x"}])
    (d / "chat_template.jinja").unlink()
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(d).render_chat([{"role": "user", "content": "x"}])


def test_the_chat_template_is_compiled_once_and_again_only_when_it_changes(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "qwen2", d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    tok = Tokenizer(d)
    compiled = tok._compiled_template()
    assert tok.render_chat([{"role": "user", "content": "a"}]) == "<a>"
    assert tok.render_chat([{"role": "user", "content": "b"}]) == "<b>"
    assert tok._compiled_template() is compiled  # jinja2's compile costs ~10 ms a request on a small CPU
    tok.chat_template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert tok.render_chat([{"role": "user", "content": "c"}]) == "[c]"
    with pytest.raises(TokenizerError, match="only user turns"):  # the sandbox's globals come with every compile
        tok.chat_template = "{{ raise_exception('only user turns') }}"
        tok.render_chat([{"role": "user", "content": "x"}])


def _stream_by_definition(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    """The streaming rule spelled out: re-decode from the last emitted piece's start; emit what the new token adds
    unless the text would end in half a character (U+FFFD) or adds nothing; flush the rest at the end."""
    prefix = read = 0
    pieces = []
    for n in range(1, len(ids) + 1):
        before, now = tok.decode(ids[prefix:read], skip), tok.decode(ids[prefix:n], skip)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            pieces.append("")
            continue
        pieces.append(now[len(before) :])
        prefix, read = read, n
    return pieces + [tok.decode(ids[prefix:], skip)[len(tok.decode(ids[prefix:read], skip)) :]]


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=40), skip=st.booleans())
def test_streaming_pieces_are_the_rule_s_whatever_the_ids(ids, skip):
    tok = Tokenizer(FIXTURES / "llama")
    stream = tok.stream(skip)
    assert [stream.push(t) for t in ids] + [stream.flush()] == _stream_by_definition(tok, ids, skip)
