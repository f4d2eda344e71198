"""What a request's cache goes through holds on the device as on the CPU, within the device's rounding: a prefix
resumed from a finished request's cache, a replay that prefills a stream's generated tokens at once, a speculation's
rolled-back proposals.

On the CPU these are bit for bit (tests/engines): a row's numbers do not depend on the step it runs in. A device's
kernels tile by the step's size, so there the stated mode is the one tests/gpu/test_device_engine.py measures for
batching: the same logits within FLOAT_RMS of their spread, and the same greedy token wherever the best two are
further apart than that rounding (the fixture's random weights make near-ties common). That each path really ran is
checked too (the resumed cache's length).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput  # noqa: E402
from shards.formats.loader import load_config  # noqa: E402
from tests.gpu.test_device_engine import FLOAT_RMS, agreement, engine, flips_only_at_near_ties  # noqa: E402
from tests.support.models import FIXTURES  # noqa: E402

MODEL = FIXTURES / "llama"


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, load_config(MODEL).vocab_size, n)


def one_at_a_time(e, rid: str, ids: np.ndarray) -> np.ndarray:
    return np.concatenate([e.forward([StepInput(rid, tokens=ids[i : i + 1])])[0] for i in range(len(ids))])


def test_a_request_resumed_from_a_retained_prefix_on_the_device_gets_a_full_prefills_logits(gpu, capsys):
    """A second turn resends the first turn's 48 tokens and adds 12: it takes over the first turn's retained cache,
    computes only the 12 (then decodes 8), against a request that computes all 60 on the same device."""
    ids = tokens(7, 68)
    e = engine(MODEL, quantize="none", device=gpu.name)
    e.retained.limit = 1 << 30
    e.forward([StepInput("turn1", tokens=ids[:48], max_positions=80)])
    assert e.retain("turn1") == [] and "turn1" in e.retained
    assert e.resume("turn2", "turn1", 48) and e.cache_length("turn2") == 48
    resumed = [e.forward([StepInput("turn2", tokens=ids[48:60], max_positions=80)], all_logits=True)[0]]
    full = [e.forward([StepInput("full", tokens=ids[:60], max_positions=80)], all_logits=True)[0][48:]]
    resumed.append(one_at_a_time(e, "turn2", ids[60:68]))
    full.append(one_at_a_time(e, "full", ids[60:68]))
    assert e.cache_length("turn2") == e.cache_length("full") == 68
    e.close()
    rms, top1 = agreement(np.concatenate(full), np.concatenate(resumed))
    with capsys.disabled():
        print(f"\n{gpu.name}: resumed prefix vs full prefill, 20 positions: relative RMS {rms:.2e}, top-1 {top1:.3f}")
    assert rms < FLOAT_RMS and flips_only_at_near_ties(np.concatenate(full), np.concatenate(resumed))


def test_a_request_resumed_from_a_branch_on_the_device_gets_a_full_prefills_logits(gpu, capsys):
    """Two finished requests share their first 32 tokens; the second is held as a branch (its own 16 positions on
    the device, after the first's 32). A request resuming from its 48 positions gets them copied, root first, into
    its own range, and computes 12 more (then decodes 8) as a request that computes all 60."""
    ids, own = tokens(9, 68), tokens(10, 16)
    e = engine(MODEL, quantize="none", device=gpu.name)
    e.retained.limit = 1 << 30
    e.forward([StepInput("root", tokens=ids[:40], max_positions=80)])
    e.forward([StepInput("branch", tokens=np.concatenate([ids[:32], own]), max_positions=80)])
    assert e.retain("root") == [] and e.retain("branch") == []
    assert e.retained.branch("branch", "root", 32) and e.retained.caches["branch"].length == 16
    prompt = np.concatenate([ids[:32], own, ids[48:68]])
    assert e.resume("next", "branch", 48) and e.cache_length("next") == 48
    resumed = [e.forward([StepInput("next", tokens=prompt[48:60], max_positions=80)], all_logits=True)[0]]
    full = [e.forward([StepInput("full", tokens=prompt[:60], max_positions=80)], all_logits=True)[0][48:]]
    resumed.append(one_at_a_time(e, "next", prompt[60:68]))
    full.append(one_at_a_time(e, "full", prompt[60:68]))
    e.close()
    rms, top1 = agreement(np.concatenate(full), np.concatenate(resumed))
    with capsys.disabled():
        print(f"\n{gpu.name}: resumed branch vs full prefill, 20 positions: relative RMS {rms:.2e}, top-1 {top1:.3f}")
    assert rms < FLOAT_RMS and flips_only_at_near_ties(np.concatenate(full), np.concatenate(resumed))


def test_a_replay_on_the_device_prefilling_prompt_and_generated_tokens_gets_the_original_steps_logits(gpu, capsys):
    """What a ring does after losing a node mid-stream: the new ring prefills prompt + the 80 tokens generated so far
    in one step (past the 64 rows where kernels change) where the original decoded them one by one."""
    ids = tokens(8, 110)
    prompt, generated = ids[:30], ids[30:]
    e = engine(MODEL, quantize="none", device=gpu.name)
    e.forward([StepInput("original", tokens=prompt, max_positions=120)])
    original = one_at_a_time(e, "original", generated)
    replay = e.forward([StepInput("replay", tokens=ids, max_positions=120)], all_logits=True)[0][len(prompt) :]
    e.close()
    rms, top1 = agreement(original, replay)
    with capsys.disabled():
        print(
            f"\n{gpu.name}: replay prefill vs original decode, 80 positions: relative RMS {rms:.2e}, top-1 {top1:.3f}"
        )
    assert rms < FLOAT_RMS and top1 >= 0.95 and flips_only_at_near_ties(original, replay)


def test_rolled_back_proposals_on_the_device_leave_the_logits_of_a_cache_never_written_past(gpu):
    """Speculation's rollback: three rejected proposals written and dropped, then the accepted token, against a
    request that never saw them (the same step shapes; the dropped cells are masked, rewritten before read)."""
    ids = tokens(5, 40)
    e = engine(MODEL, quantize="none", device=gpu.name)
    for name in ("rolled", "clean"):
        e.forward([StepInput(name, tokens=ids[:30], max_positions=48)])
    e.forward([StepInput("rolled", tokens=ids[35:38])])  # proposals, rejected
    e.rollback("rolled", 30)
    rolled = e.forward([StepInput("rolled", tokens=ids[30:31])])[0]
    clean = e.forward([StepInput("clean", tokens=ids[30:31])])[0]
    e.close()
    assert np.abs(rolled - clean).max() / np.std(clean) < 1e-3 and np.argmax(rolled) == np.argmax(clean)
