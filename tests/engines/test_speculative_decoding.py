"""Speculative decoding gives the text decoding one token per trip gives: greedy answers of a node with proposals
(prompt lookup, and an oracle that proposes a few right tokens then a wrong one) equal a node's without, for
concurrent requests; and after rejected proposals each engine's cache for the request holds what a plain run's
holds: the same length, the same contents where the engine shows them (numpy), the same next logits.

numpy and MLX run the llama fixture; ggml the packaged SmolLM2 as a node runs it by default (F16,
`--float-matmul pad`) and on its file's own Q4_1 blocks (`--quantize none`), whose rows are bit-identical however
they are batched (tests/engines/test_ggml_invariance.py). (tinygrad is left out: its kernel cache is a SQLite
connection bound to the first thread that used it, and each node here has its own engine thread.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from node.grpc.client import GrpcTransport
from node.runtime.node import Node
from node.runtime.settings import NodeSettings, ServedModel
from shards.decoding.sampling import SamplingParams
from shards.engines.base import EngineInputError, StepInput
from shards.engines.registry import engine_class, engine_factory
from shards.formats.loader import load_config
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from tests.support.models import FIXTURES

LLAMA = FIXTURES / "llama"


def _smollm2():
    from tests.support.gguf_util import smollm2_path

    return smollm2_path()


ENGINES = {  # name -> (model path, engine, options, exact)
    "numpy": (lambda: LLAMA, "numpy", {}, False),
    "ggml-default": (_smollm2, "ggml", {"quantize": "f16", "threads": 1}, True),
    "ggml-q4_1": (_smollm2, "ggml", {"quantize": "none", "threads": 1}, True),
    "mlx": (lambda: LLAMA, "mlx", {}, False),
}
NEEDS = {"ggml-default": "ggml", "ggml-q4_1": "ggml", "mlx": "mlx"}  # the extra each engine needs


def _engine_params():
    return [pytest.param(name, id=name, marks=_needs(name)) for name in ENGINES]


def _needs(name: str) -> list:
    module = NEEDS.get(name)
    if module is None:
        return []
    try:
        __import__(module)
    except ImportError:
        return [pytest.mark.skip(reason=f"the {module} extra is not installed")]
    return []


class Oracle:
    """A proposer double that knows each prompt's greedy answer: it proposes the next k-1 right tokens and one
    wrong one, so every trip has accepted and rejected proposals."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int):
        self.answers, self.vocab = answers, vocab

    def propose(self, request_id, tokens, k):
        tokens = list(tokens)
        for prompt, answer in self.answers.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                right = answer[done : done + k - 1]
                wrong = (answer[done + len(right)] + 1) % self.vocab if done + len(right) < len(answer) else 0
                return (*right, wrong)[:k]
        return ()

    def release(self, request_id):
        pass


def prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (prompt lookup finds matches) and one that doesn't."""
    rng = np.random.default_rng(7)
    phrase = [int(t) for t in rng.integers(10, vocab - 10, 9)]
    return [phrase * 3, (phrase[3:] + phrase[:3]) * 2 + phrase[:4], [int(t) for t in rng.integers(10, vocab - 10, 21)]]


async def answers(name: str, speculate: str, proposer=None, max_tokens: int = 24) -> tuple[list[list[int]], dict]:
    path_of, engine, options, _ = ENGINES[name]
    path = path_of()
    cfg = load_config(path)
    node = Node(
        NodeSettings(
            node_id="n0",
            memory_bytes=1 << 32,
            engine=engine,
            speculate=speculate,
            draft_model=path if speculate == "draft" else None,
        ),
        ServedModel("m", path, cfg, Tokenizer.load(path)),
        address="127.0.0.1:1",  # one node: everything loops back, nothing is dialled
        engines=engine_factory(engine, **options),
        transport=GrpcTransport(8 << 20),
    )
    if proposer is not None:
        node.core.speculation.proposer = proposer
    node.start()

    async def one(prompt: list[int]) -> list[int]:
        out: list[int] = []
        async for message in node.generate(prompt, SamplingParams(temperature=0), max_tokens):
            out += [r.token for r in message.results]
        return out

    try:
        texts = await asyncio.gather(*(one(p) for p in prompts(cfg.vocab_size)))  # concurrent: they batch
        return list(texts), dict(node.core.counters)
    finally:
        await node.stop()
        await node.transport.close()


@pytest.fixture(scope="module", params=_engine_params())
def plain(request):
    name = request.param
    return name, asyncio.run(answers(name, "off"))[0]


def test_greedy_answers_with_prompt_lookup_are_the_answers_without(plain):
    name, want = plain
    got, counters = asyncio.run(answers(name, "lookup"))
    assert got == want
    assert counters["spec_proposed"] > 0  # proposals were made and verified


def test_greedy_answers_with_accepted_and_rejected_proposals_are_the_answers_without(plain):
    name, want = plain
    path = ENGINES[name][0]()
    vocab = load_config(path).vocab_size
    oracle = Oracle({tuple(p): a for p, a in zip(prompts(vocab), want)}, vocab)
    got, counters = asyncio.run(answers(name, "lookup", oracle))
    assert got == want
    assert 0 < counters["spec_accepted"] < counters["spec_proposed"]
    assert counters["tokens_per_trip_1"] < sum(v for k, v in counters.items() if k.startswith("tokens_per_trip_"))


# -- KV rollback ---------------------------------------------------------------------------------------------
def make(name: str):
    path_of, engine, options, exact = ENGINES[name]
    path = path_of()
    cfg = load_config(path)
    return engine_class(engine)(path, Shard("m", 0, cfg.n_layers, cfg.n_layers), cfg, **options), exact


def feed(engine, rid, tokens, all_logits=False):
    return engine.forward([StepInput(rid, tokens=np.asarray(tokens, np.int64), max_positions=64)], all_logits)[0]


@pytest.mark.parametrize("name", _engine_params())
def test_after_rejected_proposals_the_cache_is_a_plain_runs(name):
    engine, exact = make(name)
    prompt = prompts(engine.config.vocab_size)[2][:12]
    # the plain run: the prompt, then three tokens one at a time
    t1 = int(np.argmax(feed(engine, "plain", prompt)[-1]))
    t2 = int(np.argmax(feed(engine, "plain", [t1])[-1]))
    t3 = int(np.argmax(feed(engine, "plain", [t2])[-1]))
    want = feed(engine, "plain", [t3])[-1]
    # the speculative run: t1 with two proposals of which the second is wrong, then the rollback
    feed(engine, "spec", prompt)
    rows = feed(engine, "spec", [t1, t2, (t3 + 1) % engine.config.vocab_size], all_logits=True)
    assert [int(np.argmax(r)) for r in rows[:2]] == [t2, t3]  # t2 accepted, the wrong one rejected
    engine.rollback("spec", len(prompt) + 2)  # keep t1, t2
    assert engine.cache_length("spec") == len(prompt) + 2
    got = feed(engine, "spec", [t3])[-1]
    assert engine.cache_length("spec") == engine.cache_length("plain")
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if name == "numpy":  # its layer caches are numpy slabs: compare the cached keys and values themselves
        n = engine.cache_length("plain")
        for a, b in zip(engine.caches["plain"].layers, engine.caches["spec"].layers):
            np.testing.assert_allclose(a.k[:, :n], b.k[:, :n], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(a.v[:, :n], b.v[:, :n], rtol=1e-5, atol=1e-5)
    engine.release("plain")
    engine.release("spec")


@pytest.mark.parametrize("start", [-1, 13, True, 2.0], ids=["negative", "past the end", "a bool", "a float"])
def test_a_rollback_never_goes_forward_or_below_zero(start):
    engine, _ = make("numpy")
    feed(engine, "r", list(range(1, 13)))
    with pytest.raises(EngineInputError, match="cannot roll its cache of 12 positions back"):
        engine.rollback("r", start)
    assert engine.cache_length("r") == 12
    engine.rollback("r", 12)  # to the end: nothing to drop
    engine.rollback("unknown", 0)  # nothing cached, nothing dropped
    assert engine.cache_length("r") == 12


def test_a_node_refuses_a_rollback_its_engine_cannot_make():
    """The engine thread's check behind the core's: a start past the cache fails that request only."""
    from node.core.step_plan import Row, StepPlan
    from node.runtime.engine_step import run_pass

    engine, _ = make("numpy")
    feed(engine, "r", list(range(1, 5)))
    rows = (Row("r", np.array([7], np.int64), 64, start=9), Row("s", np.array([1, 2], np.int64), 64))
    done = run_pass(engine, StepPlan(engine.shard, None, rows), None)
    assert list(done.outputs.outputs) == ["s"]
    assert "cannot roll its cache of 4 positions back to 9" in done.outputs.refused["r"]


def test_the_last_shard_returns_every_row_for_requests_with_proposals_and_the_last_row_for_the_others():
    from node.core.step_plan import Row, StepPlan
    from node.runtime.engine_step import run_pass

    engine, _ = make("numpy")
    rows = (
        Row("p", np.array([1, 2, 3], np.int64), 64, proposals=(2, 3)),  # drafts: every row's logits are wanted
        Row("q", np.array([4, 5, 6, 7], np.int64), 64),
    )
    done = run_pass(engine, StepPlan(engine.shard, None, rows), None)
    assert not done.outputs.refused and done.outputs.outputs["p"].shape == (3, engine.config.vocab_size)
    assert done.outputs.outputs["q"].shape == (1, engine.config.vocab_size)


def test_greedy_answers_with_a_draft_model_are_the_answers_without():
    """The llama fixture drafting for itself (proposals computed on the engine thread before each step)."""
    want, _ = asyncio.run(answers("numpy", "off"))
    got, counters = asyncio.run(answers("numpy", "draft"))
    assert got == want and counters["spec_accepted"] > 0
