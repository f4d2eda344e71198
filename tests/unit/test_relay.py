"""Relaying (node/runtime/relay.py, node/core/step_plan.py `Row.relay`): on a ring of several nodes, a decode row's
next input comes from a peer; once the engine thread ran a relayed row it waits for that input itself, and the loop
hands it over as it comes off the link, after the checks every input gets, instead of queueing it for the worker.

The core half is driven with plain values; the runtime half runs real numpy engines on the llama fixture, two
stages of a ring on two engine threads, wired as the loop wires them.
"""

import asyncio
import threading
import time

import numpy as np
import pytest

from node.core.actions import Send
from node.core.admission import CoreLimits
from node.core.node_core import NodeCore
from node.core.requests import Activation
from node.core.scheduler import SchedulerLimits
from node.core.step_plan import Row, Sampling, StepOutputs, StepPlan, awaited, relayed_pass
from node.runtime.engine_step import Following
from node.runtime.relay import RelayInbox
from node.runtime.sampling_batcher import SamplingBatcher
from node.runtime.shard_manager import EngineCalls, ShardManager
from shards.decoding.grammar import Constraint
from shards.decoding.sampling import SamplerState, SamplingParams
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.support.factories import CFG, hidden, logits, spec, tokens
from tests.support.models import FIXTURES
from tests.unit.test_step_plan import core, of, sized

TWO = (("a", 0, 3), ("c", 3, 6))


def decoding(node: str = "b", rid: str = "r1", **kw) -> NodeCore:
    """A middle node of a three-node ring, its request's prompt (4 positions) computed and sent on."""
    b = core(node)
    b.accept_activations([Activation(rid, hidden(4), sized(rid, max_tokens=5, **kw))])
    (plan,) = b.take_batch()
    b.step_done(plan, StepOutputs({rid: hidden(4)}))
    return b


# -- the core decides what is relayed, and takes each input with the same checks ---------------------------------
def test_a_rings_decode_row_is_relayed_and_a_prompt_chunk_is_not():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(4), sized("r1", max_tokens=5))])
    ((prompt,),) = [p.rows for p in b.take_batch()]
    assert not prompt.relay
    b.accept_activations([Activation("r1", hidden())])
    ((step,),) = [p.rows for p in b.take_batch()]
    assert step.relay and step.follow is None


def test_no_row_is_relayed_on_a_one_node_ring_under_a_grammar_or_while_work_waits_for_a_later_pass():
    one = core("a")
    one.accept_prompt(spec("r1", nodes=(("a", 0, 6),), entry="a"), tokens(1, 2))
    ((row,),) = [p.rows for p in one.take_batch()]
    assert row.follow is not None and not row.relay  # its own token is its next input: followed, not relayed
    grammar = SamplingParams(temperature=0, constraint=Constraint("%llguidance {}\nstart: /[0-9]+/"))
    g = decoding(sampling=grammar)
    g.accept_activations([Activation("r1", hidden())])
    ((row,),) = [p.rows for p in g.take_batch()]
    assert not row.relay
    busy = NodeCore("b", "llama", CFG, CoreLimits(), SchedulerLimits(micro_batches=1, step_tokens=3))
    busy.accept_activations([Activation("r1", hidden(1), sized("r1", prompt=1))])
    busy.accept_activations([Activation("r2", hidden(3), sized("r2", prompt=3))])
    (plan,) = busy.take_batch()
    assert busy.queue and not any(r.relay for r in plan.rows)  # r2's prompt waits: nobody runs on by itself


def test_an_awaited_input_is_handed_back_and_recorded_as_taken_not_queued():
    b = decoding()
    refused, relayed = b.relay_activations([Activation("r1", hidden())], "a", awaited={"r1"})
    assert refused == [] and list(relayed) == ["r1"] and not b.queue
    assert b.requests["r1"].positions_in == 5 and b.counters["relayed_rows"] == 1
    b.accept_activations([Activation("r1", hidden())], "a")  # the next one comes through the queue as usual
    (plan,) = b.take_batch()
    assert b.requests["r1"].positions_in == 6 and [r.request_id for r in plan.rows] == ["r1"]


def test_an_awaited_input_is_refused_as_any_input_would_be():
    """The relay is a faster way in, not a looser one: the caller, the declared positions and the input's shape are
    checked as `accept_activations` checks them, with the same refusals."""
    wide = np.zeros((1, CFG.hidden_size + 1), np.float32)
    for bad, caller in ((Activation("r1", hidden()), "c"), (Activation("r1", wide), "a")):
        queued, relayed = decoding(), decoding()
        expected = queued.accept_activations([bad], caller)
        refused, handed = relayed.relay_activations([bad], caller, awaited={"r1"})
        assert refused == expected and len(refused) == 1 and handed == {}
    full = decoding()
    for _ in range(5):  # 4 prompt positions + 5 new = 9 declared: a sixth next input is one too many
        _, handed = full.relay_activations([Activation("r1", hidden())], "a", awaited={"r1"})
        assert handed
    (refusal,), handed = full.relay_activations([Activation("r1", hidden())], "a", awaited={"r1"})
    assert "declared" in refusal.reason and handed == {}


def test_inputs_nobody_waits_for_or_that_are_not_a_plain_next_position_are_queued():
    b = decoding()
    _, relayed = b.relay_activations([Activation("r1", hidden())], "a", awaited=set())
    assert relayed == {} and len(b.queue) == 1
    c = decoding()
    explicit = Activation("r1", hidden(2), proposals=(7,), start=4)  # a row with a draft to verify
    _, relayed = c.relay_activations([explicit], "a", awaited={"r1"})
    assert relayed == {} and len(c.queue) == 1


def drafting_first_node() -> NodeCore:
    """The first node of a two-node ring under prompt lookup, its request's prompt 5 6 7 8 computed and sent on."""
    from node.core.speculation import Speculation
    from shards.decoding.speculation import PromptLookup

    a = NodeCore(
        "a",
        "llama",
        CFG,
        CoreLimits(),
        SchedulerLimits(micro_batches=1),
        speculation=Speculation(PromptLookup(), vocab=CFG.vocab_size),
    )
    a.accept_prompt(spec("r1", nodes=TWO, entry="a", max_tokens=20), tokens(5, 6, 7, 8))
    (plan,) = a.take_batch()
    a.step_done(plan, StepOutputs({"r1": hidden(4)}))
    return a


def test_a_first_nodes_token_is_relayed_unless_the_proposer_drafts_after_it():
    """Under prompt lookup (the default) the first node makes the proposals as each token comes back: a token after
    which it drafts nothing is relayed, one after which it drafts goes to the queue with its drafts."""
    a = drafting_first_node()
    _, relayed = a.relay_activations([Activation("r1", tokens(9))], "c", awaited={"r1"})
    assert relayed["r1"].tolist() == [9] and not a.queue  # (8, 9) never seen: nothing to draft
    _, relayed = a.relay_activations([Activation("r1", tokens(5))], "c", awaited={"r1"})
    assert relayed  # (9, 5) neither
    _, relayed = a.relay_activations([Activation("r1", tokens(6))], "c", awaited={"r1"})
    (queued,) = a.queue.queue
    assert relayed == {} and queued.proposals == (7, 8) and queued.data.tolist() == [6, 7, 8]


# -- the plan's side: which rows wait, and the pass their inputs make ---------------------------------------------
def test_a_relayed_pass_carries_each_input_that_came_and_keeps_the_rows_sampling():
    last = Shard("llama", 3, 6, 6)
    ask = Sampling(SamplingParams(temperature=0), SamplerState())
    rows = (
        Row("x", hidden(), 9, sample=ask, relay=True),
        Row("y", hidden(), 9, sample=ask, relay=True),
        Row("z", hidden(), 9, sample=ask),
    )
    plan = StepPlan(last, 1, rows, 77)
    assert awaited(plan, {"x": logits(), "z": logits()}) == ("x",)  # y was refused by the engine; z is not relayed
    nxt = relayed_pass(plan, {"y": np.ones((1, CFG.hidden_size), np.float32)})
    (row,) = nxt.rows
    assert (row.request_id, row.relay, row.sample, row.max_positions, nxt.retain_limit) == ("y", True, ask, 9, 77)
    assert row.data[0, 0] == 1 and relayed_pass(plan, {}) is None
    with pytest.raises(ValueError, match="relayed"):
        Row("p", hidden(4), 9, relay=True)  # a prompt chunk is never relayed


# -- the inbox between the loop and the engine thread --------------------------------------------------------------
def test_the_engine_thread_gets_an_input_the_loop_offers_while_it_waits_and_the_core_queues_the_rest():
    inbox = RelayInbox(lambda: True, wait_s=5)
    got = []
    waiter = threading.Thread(target=lambda: got.append(inbox.wait(["r1"])))
    waiter.start()
    while not inbox._awaiting:
        time.sleep(0.001)
    seen = []

    def take(waited):
        seen.append(waited)
        return "refusals", {"r1": hidden()}

    result, handed = inbox.offer(take)
    assert result == "refusals" and list(handed) == ["r1"]
    waiter.join(5)
    ((inputs, idle),) = got
    assert seen == [frozenset({"r1"})] and list(inputs) == ["r1"] and idle >= 0
    assert inbox.offer(lambda waited: (waited, {})) == (frozenset(), {})  # nobody waits now: all to the queue
    with pytest.raises(ValueError, match="nobody waits"):
        inbox.offer(lambda waited: (None, {"r9": hidden()}))


def test_a_wait_ends_without_input_when_interrupted_or_after_its_limit_and_gathers_a_passes_inputs_briefly():
    running = [True]
    inbox = RelayInbox(lambda: running[0], wait_s=0.05, gather_s=0.02)
    started = time.perf_counter()
    assert inbox.wait(["r1"]) == ({}, 0.0) and time.perf_counter() - started >= 0.05  # a peer that stalled
    long = RelayInbox(lambda: running[0], wait_s=30)
    threading.Timer(0.05, lambda: (running.__setitem__(0, False), long.wake())).start()
    started = time.perf_counter()
    assert long.wait(["r1"]) == ({}, 0.0) and time.perf_counter() - started < 10  # interrupted: new work came
    two = RelayInbox(lambda: True, wait_s=5, gather_s=0.03)
    got = []
    waiter = threading.Thread(target=lambda: got.append(two.wait(["x", "y"])))
    waiter.start()
    while not two._awaiting:
        time.sleep(0.001)
    two.offer(lambda waited: (None, {"x": hidden()}))
    waiter.join(5)
    assert list(got[0][0]) == ["x"]  # y did not come within the gather time: its pass goes without it
    assert two.offer(lambda waited: (waited, {})) == (frozenset(), {})  # and y, when it comes, is queued


def test_an_inbox_refuses_negative_waits():
    with pytest.raises(ValueError, match="never negative"):
        RelayInbox(lambda: True, wait_s=-1)


# -- a ring of two engine threads, wired as the loop wires them ----------------------------------------------------
def test_a_ring_relayed_on_its_engine_threads_gives_the_tokens_of_the_whole_model_pass_by_pass():
    """Exactness: two stages whose decode rows run on their peer's input as the loop hands it over (the first
    stage's hidden rows to the last, the last's sampled token back to the first) give the seeded tokens of the whole
    model run one pass at a time; every pass after the first two is relayed, laid out before its input came (its plan:
    the numpy engine lays out no step of its own ahead), and the run ends with an interrupt."""
    factory = lambda d, s, c: NumpyEngine(d, s, ModelConfig.from_dir(d))  # noqa: E731

    class Paced(NumpyEngine):  # a pass as long as a real model's: a stage waits before its input can come
        def forward(self, *args, **kw):
            time.sleep(0.01)
            return super().forward(*args, **kw)

    paced = lambda d, s, c: Paced(d, s, ModelConfig.from_dir(d))  # noqa: E731
    first, last, whole = Shard("llama", 0, 3, 6), Shard("llama", 3, 6, 6), Shard("llama", 0, 6, 6)
    params, n = SamplingParams(temperature=0.8, seed=7), 8

    async def ring():
        a, c = ShardManager(FIXTURES / "llama", CFG, paced), ShardManager(FIXTURES / "llama", CFG, paced)
        batcher = SamplingBatcher(8, 60_000, executor=c.executor)
        ea, ec = await a.get(first), await c.get(last)
        ask = Sampling(params, SamplerState.from_seed(7))
        loop, done_all = asyncio.get_running_loop(), asyncio.Event()
        sampled, relayed, laid = [], [], []

        def hand(following: Following, rid: str, data: np.ndarray) -> bool:
            _, handed = following.relay.offer(lambda waited: (None, {rid: data} if rid in waited else {}))
            return bool(handed)

        def at_a(done):  # the first stage's pass: its hidden rows go to the last stage
            relayed.append(done.relayed)
            laid.append(done.ahead)
            out = done.outputs.outputs["r"]
            if not hand(fc, "r", out):  # not waited for (the prompt, or a run that ended): as the worker runs it
                row = Row("r", out, 20, sample=ask, relay=len(out) == 1)
                loop.create_task(c.execute(ec, StepPlan(last, None, (row,)), batcher, fc))

        def at_c(done):  # the last stage's pass: its token goes back to the first
            relayed.append(done.relayed)
            laid.append(done.ahead)
            token = done.outputs.samples["r"].token
            sampled.append(token)
            if len(sampled) == n:
                fa.interrupt(), fc.interrupt(), done_all.set()
            elif not hand(fa, "r", tokens(token)):
                loop.create_task(
                    a.execute(ea, StepPlan(first, None, (Row("r", tokens(token), 20, relay=True),)), None, fa)
                )

        fa, fc = Following(at_a), Following(at_c)
        await a.execute(ea, StepPlan(first, None, (Row("r", tokens(5, 6, 7), 20),)), None, fa)
        await asyncio.wait_for(done_all.wait(), 30)
        await batcher.close()
        a.close(), c.close()
        return sampled, relayed, laid

    async def alone():
        m = ShardManager(FIXTURES / "llama", CFG, factory)
        batcher = SamplingBatcher(8, 60_000, executor=m.executor)
        engine, state, data, got = await m.get(whole), SamplerState.from_seed(7), tokens(5, 6, 7), []
        for _ in range(n):
            done = await m.execute(
                engine, StepPlan(whole, None, (Row("r", data, 20, sample=Sampling(params, state)),)), batcher
            )
            got.append(done.outputs.samples["r"].token)
            data = tokens(got[-1])
        await batcher.close()
        m.close()
        return got

    sampled, relayed, laid = asyncio.run(ring())
    assert sampled == asyncio.run(alone())
    # the prompt's two passes, then each stage's first decode pass from the worker, and the rest relayed
    assert relayed[:4] == [False] * 4 and all(relayed[4:]) and len(relayed) == 2 * n
    assert laid[:4] == [(False, False)] * 4 and set(laid[4:]) == {(True, False)}


def test_the_core_routes_a_relayed_pass_as_any_pass():
    """What a relayed pass made is routed by `step_done` as any pass's outputs: nothing of the relay shows in the
    actions."""
    b = decoding()
    b.accept_activations([Activation("r1", hidden())], "a")
    (plan,) = b.take_batch()
    (send,) = of(Send, b.step_done(plan, StepOutputs({"r1": hidden()})))
    assert send.address == "h:3" and send.activations[0].spec is None
    _, relayed = b.relay_activations([Activation("r1", hidden())], "a", awaited={"r1"})
    nxt = relayed_pass(plan, relayed)
    (send,) = of(Send, b.step_done(nxt, StepOutputs({"r1": hidden()})))
    assert send.address == "h:3" and b.requests["r1"].positions_in == 6
    (row,), (before,) = nxt.rows, plan.rows
    assert (row.max_positions, row.prompt_positions, row.relay) == (before.max_positions, before.prompt_positions, True)


def test_a_call_for_the_engine_thread_ends_a_relay_wait_so_it_never_waits_behind_it():
    """The sampling batcher samples on the engine thread too: its call (`EngineCalls`) ends a relayed row's wait
    for its input at once, where a bare submission waits for the wait's end."""
    factory = lambda d, s, c: NumpyEngine(d, s, ModelConfig.from_dir(d))  # noqa: E731
    last = Shard("llama", 3, 6, 6)

    async def waited(call) -> float:
        shards = ShardManager(FIXTURES / "llama", CFG, factory)
        following = Following(lambda done: None)
        shards.interrupt = following.interrupt  # as the pipeline sets it
        engine = await shards.get(last)
        plan = StepPlan(last, None, (Row("r", hidden(), 20, relay=True),))
        await shards.execute(engine, plan, None, following)  # the engine thread now waits for r's next input
        started = time.perf_counter()
        await asyncio.wrap_future(call(shards).submit(lambda: None))
        took = time.perf_counter() - started
        shards.close()
        return took

    assert asyncio.run(waited(EngineCalls)) < 0.25
    assert asyncio.run(waited(lambda shards: shards.executor)) >= 0.4  # the wait's 0.5 s, for want of an interrupt
