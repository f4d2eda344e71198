"""The sampling batcher verifies blocks of rows with proposals (speculative decoding): each resolves to the tokens
`shards.decoding.speculation.verify` emits for it alone, batched with other blocks and plain rows, after a batched sampler
that fails, and on an engine without a batched sampler; a block of the wrong shape is refused at the door."""

import numpy as np
import pytest

from node.runtime.sampling_batcher import SampleItem, SamplingBatcher
from shards.decoding.sampling import sample_one
from shards.decoding.speculation import verify
from tests.unit.test_sampling_batcher import LONG, NoBatch, Recording, fresh_states, params, rows, run, sample_all

DRAFTS = [(5, 9), (), (7, 7, 7)]  # the middle request has a plain row


def blocks(engine, states):
    logits = rows(8, seed=4)
    # a greedy request's drafts are its argmaxes, so some are accepted; the others are sampled at temperature 0.9
    greedy = params(0).__class__(temperature=0)
    first = (int(np.argmax(logits[0])), int(np.argmax(logits[1])))
    specs = [(logits[0:3], first, greedy), (logits[3], (), params(1)), (logits[4:8], DRAFTS[2], params(2))]
    return [
        SampleItem(f"r{i}", block, p, st, engine, "m", drafts)
        for i, ((block, drafts, p), st) in enumerate(zip(specs, states))
    ]


def expected():
    want = []
    for item in blocks(Recording(), fresh_states(3)):
        if item.drafts:
            want.append(verify(item.logits, item.drafts, item.params, item.state))
        else:
            want.append(sample_one(item.logits, item.params, item.state))
    return want


@pytest.mark.parametrize("engine", [Recording, lambda: Recording("raise"), NoBatch], ids=["batched", "fails", "none"])
def test_blocks_with_proposals_verify_as_alone_beside_plain_rows(engine):
    async def go():
        return await sample_all(SamplingBatcher(8, LONG), blocks(engine(), fresh_states(3)), flush=True)

    got = run(go())
    want = expected()
    assert got == want
    assert isinstance(got[0], list) and len(got[0]) == 3  # both greedy drafts accepted, plus the bonus token
    assert got[0][:2] == [type(got[0][0])(t) for t in blocks(Recording(), fresh_states(3))[0].drafts]


def test_a_block_whose_rows_do_not_match_its_drafts_is_refused():
    async def go():
        item = SampleItem("r", rows(2), params(0), fresh_states(1)[0], Recording(), "m", (1, 2))  # needs 3 rows
        with pytest.raises(ValueError, match="a row for each of"):
            SamplingBatcher(8, LONG).submit(item)

    run(go())
