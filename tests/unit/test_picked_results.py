"""What rows whose greedy tokens the engine picked emit (node/runtime/sample_rows.py `picked_results`): exactly what
the sampler's verification gives greedy rows from their logits, a token for a lone row and, for a block with
proposals, the drafts equal to their row's token and the token after them; and what a pass asks the engine for
(`wants`)."""

import numpy as np
import pytest

from node.core.step_plan import Row, Sampling, StepPlan
from node.runtime.sample_rows import MalformedBatch, picked_results, wants
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.decoding.speculation import verify_blocks
from shards.engines.picks import Draw
from shards.model.shard import Shard
from tests.support.factories import hidden

LAST = Shard("llama", 4, 6, 6)
VOCAB = 32
GREEDY = SamplingParams(temperature=0.0)


def row(rid: str, proposals: tuple[int, ...] = ()) -> Row:
    return Row(rid, hidden(len(proposals) + 1), proposals=proposals, sample=Sampling(GREEDY, SamplerState()))


def rows_peaking_at(tokens: tuple[int, ...]) -> np.ndarray:
    """Logits whose row i has its one maximum at tokens[i]."""
    out = np.random.default_rng(len(tokens)).standard_normal((len(tokens), VOCAB)).astype(np.float32)
    out[np.arange(len(tokens)), list(tokens)] = 10.0
    return out


@pytest.mark.parametrize(
    "drafts, tokens",
    [
        ((), (4,)),  # a lone row
        ((5, 6, 7), (5, 6, 7, 9)),  # every draft accepted, then the bonus token
        ((5, 6, 7), (3, 6, 7, 9)),  # the first rejected: the row's own token in its place
        ((5, 6, 7), (5, 2, 7, 9)),  # one accepted
        ((5,), (5, 5)),
    ],
)
def test_picked_blocks_emit_what_greedy_verification_of_their_logits_emits(drafts, tokens):
    plan = StepPlan(LAST, None, (row("a", drafts), row("b")))
    got = picked_results(plan, {"a": tokens, "b": (1,)})
    want = verify_blocks(rows_peaking_at(tokens), [drafts], [GREEDY], [SamplerState()])[0]
    assert got["b"] == SampleResult(1)
    assert (got["a"] if drafts else [got["a"]]) == [SampleResult(r.token) for r in want]


def test_rows_not_picked_are_left_to_the_sampler_and_a_wrong_count_of_tokens_is_refused():
    plan = StepPlan(LAST, None, (row("a", (5, 6)), row("b")))
    assert picked_results(plan, {"b": (3,)}) == {"b": SampleResult(3)}
    with pytest.raises(MalformedBatch, match="2 picked tokens for a block of 3 rows"):
        picked_results(plan, {"a": (5, 6)})


def test_a_pass_asks_greedy_rows_for_tokens_and_plain_top_k_rows_without_proposals_for_candidates_where_taken():
    ollama = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1)

    def sampled(rid: str, params: SamplingParams, proposals: tuple[int, ...] = ()) -> Row:
        return Row(rid, hidden(len(proposals) + 1), proposals=proposals, sample=Sampling(params, SamplerState()))

    plan = StepPlan(
        LAST,
        None,
        (
            sampled("greedy", GREEDY),
            sampled("greedy block", GREEDY, (5, 6)),
            sampled("top-k", ollama),
            sampled("top-k block", ollama, (5,)),  # verification reads every row's whole distribution
            sampled("nucleus", SamplingParams(temperature=0.8, top_p=0.9)),
            sampled("logprobs", SamplingParams(temperature=0.8, top_k=40, top_logprobs=1)),
        ),
    )
    assert wants(plan, best=True) == {"greedy": True, "greedy block": True, "top-k": Draw(40, 0.8)}
    assert wants(plan, best=False) == {"greedy": True, "greedy block": True}  # an engine that takes none
