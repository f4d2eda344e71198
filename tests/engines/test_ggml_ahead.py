"""A decode step laid out before its input's values are known (`Engine.ahead`; the ggml engine's lone row that
follows its last step: shards/engines/ggml/next_row.py `step_ahead`), then run once they are, is bit for bit the
step run as usual, on a ring's first stage (a token) and its last (a hidden row, picked or not). A step laid out and
never run, or refused for its values, changes nothing a later step sees; a step that is not a lone row's next is
not laid out ahead."""

import dataclasses

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import EngineInputError, StepInput
from shards.engines.ggml.engine import GgmlEngine
from shards.formats.loader import load_config
from shards.model.shard import Shard
from tests.support.gguf_util import smollm2_path


def stages() -> tuple[GgmlEngine, GgmlEngine]:
    """A two-node ring's stages of the packaged SmolLM2 cut to two layers: one layer each."""
    path = smollm2_path()
    cfg = dataclasses.replace(load_config(path), n_layers=2)
    make = lambda s: GgmlEngine(path, s, cfg, threads=1, quantize="none", adapt_threads=False)  # noqa: E731
    return make(Shard("m", 0, 1, 2)), make(Shard("m", 1, 2, 2))


def laid(e: GgmlEngine, rid: str, value: np.ndarray, wanted: list[bool] | None):
    """The step laid out on a zeroed buffer of `value`'s shape, the value copied in, then run (None: not laid out)."""
    buffer = np.zeros_like(value)
    item = StepInput(rid, tokens=buffer) if e.shard.is_first else StepInput(rid, hidden=buffer)
    call = e.ahead([item], wanted)
    if call is None:
        return None
    buffer[...] = value
    return call()


def usual(e: GgmlEngine, rid: str, value: np.ndarray, wanted: list[bool] | None):
    item = StepInput(rid, tokens=value) if e.shard.is_first else StepInput(rid, hidden=value)
    return e.forward([item]) if wanted is None else e.pick([item], wanted)


def test_a_ring_laid_out_ahead_gives_every_step_bit_for_bit_and_skips_none_but_the_first():
    ahead, plain = stages(), stages()
    try:
        prompt = np.arange(200, 212)
        token = {}
        for pair, name in ((ahead, "ahead"), (plain, "plain")):
            first, last = pair
            hidden = first.forward([StepInput("r", tokens=prompt, max_positions=300)])[0]
            token[name] = int(np.argmax(last.forward([StepInput("r", hidden=hidden, max_positions=300)])[0][-1]))
        laid_steps = 0
        for k in range(40):
            pick = None if k % 5 == 2 else [True]  # now and then the logits come back instead of the token
            t = np.array([token["plain"]])
            want_hidden = usual(plain[0], "r", t, None)[0]
            got_hidden = laid(ahead[0], "r", t, None)
            if got_hidden is None:  # (only a step that follows a lone decode step is laid out ahead)
                got_hidden = usual(ahead[0], "r", t, None)[0]
            else:
                got_hidden, laid_steps = got_hidden[0], laid_steps + 1
            assert np.array_equal(got_hidden, want_hidden), f"step {k}: the first stage's hidden row differs"
            want = usual(plain[1], "r", want_hidden, pick)[0]
            got = laid(ahead[1], "r", got_hidden, pick) or usual(ahead[1], "r", got_hidden, pick)
            got = got[0]
            if pick is None:
                assert np.array_equal(got, want), f"step {k}: the last stage's logits differ"
                token["plain"] = int(np.argmax(want[-1]))
            else:
                assert got.tokens == want.tokens and np.array_equal(got.logits, want.logits), f"step {k}"
                token["plain"] = want.tokens[0] if want.tokens is not None else int(np.argmax(want.logits[-1]))
        assert laid_steps >= 38
        for a, p in zip(ahead, plain):
            assert a.cache_length("r") == p.cache_length("r") == 12 + 40
    finally:
        for e in (*ahead, *plain):
            e.close()


def test_a_step_laid_out_and_never_run_or_refused_for_its_values_changes_nothing_later():
    ahead, plain = stages(), stages()
    try:
        for e in (ahead[0], plain[0]):
            e.forward([StepInput("r", tokens=np.arange(300, 310), max_positions=300)])
        t = 7
        for k in range(12):
            if k % 3 == 1:  # laid out, then left: the ring's input never came
                assert ahead[0].ahead([StepInput("r", tokens=np.zeros(1, np.int64))], None) is not None
            if k % 4 == 3:  # laid out, then a token outside the vocabulary: refused before anything ran
                buffer = np.zeros(1, np.int64)
                call = ahead[0].ahead([StepInput("r", tokens=buffer)], None)
                buffer[0] = ahead[0].config.vocab_size
                with pytest.raises(EngineInputError, match="out of range"):
                    call()
            got = usual(ahead[0], "r", np.array([t]), None)[0]
            want = usual(plain[0], "r", np.array([t]), None)[0]
            assert np.array_equal(got, want), f"step {k}"
            assert ahead[0].cache_length("r") == plain[0].cache_length("r")
            t = int(np.abs(got[0, :50]).argmax()) + 100
    finally:
        for e in (*ahead, *plain):
            e.close()


def test_only_a_lone_rows_next_step_is_laid_out_ahead():
    first, last = stages()
    try:
        one = lambda rid: [StepInput(rid, tokens=np.zeros(1, np.int64))]  # noqa: E731
        assert first.ahead(one("r"), None) is None  # nothing ran yet
        first.forward([StepInput("r", tokens=np.arange(100, 110), max_positions=300)])
        assert first.ahead(one("r"), None) is None  # after a prompt
        first.forward(one("r"))
        assert first.ahead(one("s"), None) is None  # another request (and no cache made for it)
        assert first.cache_length("s") == 0 and "s" not in first.caches
        assert first.ahead([StepInput("r", tokens=np.zeros(2, np.int64))], None) is None  # two positions
        assert first.ahead(one("r") + one("s"), None) is None  # two rows
        assert first.ahead(one("r"), [True]) is None  # a pick on a first stage: not this step's kind
        assert first.ahead(one("r"), None) is not None  # the row's next step
        first.runner.next_rows = False  # an engine that lays out every step in full lays out none ahead
        assert first.ahead(one("r"), None) is None
    finally:
        first.close()
        last.close()
