"""The last shard's sampling batcher. Timing never decides an outcome: windows are long (the test flushes) or the
assertion only says the window was waited for (a lower bound)."""

import asyncio
import time

import numpy as np
import pytest

from node.runtime.sampling_batcher import BatcherClosed, SampleItem, SamplingBatcher
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams, sample_one
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.conftest import FIXTURES

LONG = 60_000  # ms: a window that never closes a batch during a test


class Recording(NumpyEngine):
    """A real numpy engine whose batched sampler calls are counted (and can be made to misbehave)."""

    def __init__(self, mode="ok"):
        d = FIXTURES / "llama"
        super().__init__(d, Shard("llama", 5, 6, 6), ModelConfig.from_dir(d))
        self.mode, self.calls = mode, []

    def sample(self, logits, params, states):
        self.calls.append(len(params))
        results = super().sample(logits, params, states)  # draws from every state first
        if self.mode == "raise":
            raise RuntimeError("device lost")
        if self.mode == "short":
            return results[:-1]
        if self.mode == "out_of_range":
            return [SampleResult(10**6)] * len(results)
        if self.mode == "nan_logprob":
            return [SampleResult(r.token, float("nan"), r.top_logprobs) for r in results]
        return results


class NoBatch(Recording):
    batched_sampling = False


def rows(n, vocab=512, seed=0):
    return np.random.default_rng(seed).normal(0, 2, size=(n, vocab)).astype(np.float32)


def params(i):
    return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, top_logprobs=2 if i % 2 else None)


def items(engine, logits, states, model_id="m"):
    return [
        SampleItem(f"r{i}", row, params(i), st, engine, model_id) for i, (row, st) in enumerate(zip(logits, states))
    ]


async def sample_all(batcher, its, flush=False):
    futures = [batcher.submit(it) for it in its]
    if flush:
        batcher.flush()
    return await asyncio.wait_for(asyncio.gather(*futures), 30)


def run(coro):
    return asyncio.run(coro)


def fresh_states(n):
    return [SamplerState.from_seed(100 + i) for i in range(n)]


def test_full_batch_of_8_closes_at_once_with_one_sampler_call():
    async def go():
        engine, b = Recording(), SamplingBatcher(8, LONG)
        results = await sample_all(b, items(engine, rows(8), fresh_states(8)))  # no flush: the 8th item closes it
        assert len(results) == 8 and engine.calls == [8]
        assert b.stats["sample_batch_size_8"] == 1 and b.stats["sample_fallbacks"] == 0
        await b.close()

    run(go())


def test_a_lone_item_closes_after_the_window():
    async def go():
        engine, b = Recording(), SamplingBatcher(8, window_ms=50)
        t = time.monotonic()
        future = b.submit(items(engine, rows(1), fresh_states(1))[0])
        await asyncio.sleep(0)
        assert not future.done()
        await asyncio.wait_for(future, 30)
        assert time.monotonic() - t >= 0.05 and b.stats["sample_batch_size_1"] == 1
        await b.close()

    run(go())


def test_mixed_vocab_sizes_and_revisions_form_separate_groups():
    async def go():
        engine, b = Recording(), SamplingBatcher(8, LONG)
        its = items(engine, rows(3, 100), fresh_states(3)) + items(engine, rows(3, 200), fresh_states(3))
        its += items(engine, rows(2, 100), fresh_states(2), "other-model")
        results = await sample_all(b, its)
        assert sorted(engine.calls) == [2, 3, 3] and b.stats["sample_batches"] == 1
        assert all(r.token < 100 for r in results[:3]) and all(r.token < 200 for r in results[3:6])
        await b.close()

    run(go())


@pytest.mark.parametrize("mode", ["raise", "short", "out_of_range", "nan_logprob"])
def test_a_failing_or_malformed_batched_sampler_falls_back_per_request(mode):
    async def go():
        logits = rows(6)
        good, bad = Recording(), Recording(mode)
        b1, b2 = SamplingBatcher(8, LONG), SamplingBatcher(8, LONG)
        expected = await sample_all(b1, items(good, logits, fresh_states(6)), flush=True)
        got = await sample_all(b2, items(bad, logits, fresh_states(6)), flush=True)
        assert got == expected  # every request still gets its (same) token
        assert b2.stats["sample_fallbacks"] == 6 and bad.calls == [6]
        await b1.close()
        await b2.close()

    run(go())


def test_an_engine_without_a_batched_sampler_is_sampled_per_request():
    async def go():
        engine, b = NoBatch(), SamplingBatcher(8, LONG)
        results = await sample_all(b, items(engine, rows(4), fresh_states(4)), flush=True)
        assert len(results) == 4 and engine.calls == [] and b.stats["sample_fallbacks"] == 4
        await b.close()

    run(go())


def test_seeded_tokens_are_identical_alone_batched_and_through_the_fallback():
    logits = [rows(8, seed=s) for s in range(5)]  # 5 decode steps of 8 requests

    async def steps(batcher, engine):
        states, out = fresh_states(8), []
        for step in logits:
            out.append([r.token for r in await sample_all(batcher, items(engine, step, states), flush=True)])
        return out

    async def go():
        alone = await steps(SamplingBatcher(1, 5), Recording())
        batched = await steps(SamplingBatcher(8, LONG), Recording())
        fallback = await steps(SamplingBatcher(8, LONG), Recording("raise"))  # the failed call drew from the RNGs
        direct = [
            [sample_one(row, params(i), st).token for i, (row, st) in enumerate(zip(step, sts))]
            for sts in [fresh_states(8)]
            for step in logits
        ]
        assert alone == batched == fallback == direct

    run(go())


def test_a_cancelled_waiter_does_not_disturb_the_others():
    async def go():
        engine, b = Recording(), SamplingBatcher(8, LONG)
        futures = [b.submit(it) for it in items(engine, rows(3), fresh_states(3))]
        futures[1].cancel()
        b.flush()
        done = await asyncio.wait_for(asyncio.gather(futures[0], futures[2]), 30)
        assert len(done) == 2 and engine.calls == [2]
        # and a cancellation racing the sampling is harmless too
        futures = [b.submit(it) for it in items(engine, rows(2), fresh_states(2))]
        b.flush()
        futures[0].cancel()
        assert (await asyncio.wait_for(futures[1], 30)).token >= 0
        await b.close()

    run(go())


def test_a_bad_item_is_refused_alone_and_a_failing_request_fails_alone():
    class FailsForTopK7(NoBatch):
        def sample_one(self, logits, p, state):
            if p.top_k == 7:
                raise ValueError("unsupported")
            return super().sample_one(logits, p, state)

    async def go():
        engine, b = FailsForTopK7(), SamplingBatcher(8, LONG)
        with pytest.raises(ValueError):
            b.submit(SampleItem("nan", np.full(10, np.nan, np.float32), params(0), SamplerState(), engine, "m"))
        its = items(engine, rows(3), fresh_states(3))
        its[1] = SampleItem("r1", its[1].logits, SamplingParams(top_k=7, seed=1), SamplerState(), engine, "m")
        futures = [b.submit(it) for it in its]
        b.flush()
        results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 30)
        assert isinstance(results[1], ValueError)
        assert isinstance(results[0], SampleResult) and isinstance(results[2], SampleResult)
        assert b.stats["sample_errors"] == 1
        await b.close()

    run(go())


def test_shutdown_fails_pending_waiters_clearly_and_refuses_new_items():
    async def go():
        engine, b = Recording(), SamplingBatcher(8, LONG)
        future = b.submit(items(engine, rows(1), fresh_states(1))[0])
        await b.close()
        with pytest.raises(BatcherClosed):
            await asyncio.wait_for(future, 30)
        with pytest.raises(BatcherClosed):
            b.submit(items(engine, rows(1), fresh_states(1))[0])

    run(go())


def test_window_0_or_max_1_disables_batching():
    async def go():
        for b in (SamplingBatcher(1, LONG), SamplingBatcher(8, 0)):
            engine = Recording()
            await sample_all(b, items(engine, rows(4), fresh_states(4)))  # resolves without any flush
            assert engine.calls == [] and b.stats["sample_batch_size_1"] == 4
            await b.close()

    run(go())


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("at", [0, 5, 9])
def test_a_row_with_one_nan_or_plus_inf_anywhere_is_refused_and_minus_inf_is_a_masked_token(bad, at):
    async def go():
        engine, b = NoBatch(), SamplingBatcher(8, LONG)
        logits = np.linspace(-1, 1, 10, dtype=np.float32)
        logits[at] = bad
        with pytest.raises(ValueError, match="finite"):
            b.submit(SampleItem("bad", logits, params(0), SamplerState(), engine, "m"))
        masked = np.linspace(-1, 1, 10, dtype=np.float32)
        masked[at] = -np.inf
        future = b.submit(SampleItem("masked", masked, params(0), SamplerState(), engine, "m"))
        b.flush()
        assert (await asyncio.wait_for(future, 30)).token != at
        await b.close()

    run(go())


@pytest.mark.parametrize("engine_kind", [Recording, NoBatch])
def test_sampling_a_pass_where_it_ran_gives_what_the_batch_would_and_counts_the_same(engine_kind):
    """The pipeline samples a pass's rows on the engine thread (sample_now), not through submit and flush: same
    tokens, logprobs and counters, and a row submit would refuse is left for submit to refuse."""

    async def go():
        engine = engine_kind()
        logits = rows(6, 300, seed=3)
        logits[4, 7] = np.nan
        through_batch, now = SamplingBatcher(8, LONG), SamplingBatcher(8, LONG)
        its = items(engine, logits, fresh_states(6))
        good = [it for k, it in enumerate(its) if k != 4]
        expected = await sample_all(through_batch, good, flush=True)
        results, counts = now.sample_now(items(engine, logits, fresh_states(6)))
        now.record(counts)
        assert sorted(results) == ["r0", "r1", "r2", "r3", "r5"]  # r4's NaN: left to submit, which refuses it
        assert [results[it.request_id] for it in good] == expected
        assert now.stats == through_batch.stats
        await through_batch.close()
        await now.close()

    run(go())


def test_a_pass_of_more_rows_than_a_batch_holds_is_sampled_in_batches_of_max_batch():
    async def go():
        engine, b = Recording(), SamplingBatcher(4, LONG)
        results, batches = b.sample_now(items(engine, rows(10, 200), fresh_states(10)))
        b.record(batches)
        assert len(results) == 10 and engine.calls == [4, 4, 2]
        assert b.stats["sample_batch_size_4"] == 2 and b.stats["sample_batch_size_2"] == 1
        assert b.stats["sample_items"] == 10 and b.stats["sample_batches"] == 3
        await b.close()

    run(go())
