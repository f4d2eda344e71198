"""Speculative decoding in the core, driven with plain values: the first node turns a returned token into
[t, d1..dk] with its proposals and cache position, the last node answers with every accepted token and the next
input's `start`, and a `start` may only drop the previous input's proposals (node/core/speculation.py)."""

import dataclasses

import numpy as np
import pytest

from node.core.actions import Deliver, Release, Sample, Send
from node.core.admission import CoreLimits
from node.core.node_core import NodeCore
from node.core.requests import Activation
from node.core.scheduler import Queued, SchedulerLimits, StepScheduler
from node.core.speculation import Speculation, SpeculationLimits
from node.core.step_plan import StepOutputs
from node.grpc import wire
from shards.decoding.sampling import SampleResult, SamplingParams
from shards.model.shard import Shard
from tests.support.factories import CFG, STOP, hidden, spec, tokens


class Fixed:
    """A proposer double: always proposes `drafts` (cut to k), and remembers what it was shown."""

    def __init__(self, drafts=(7, 8, 9), fail=False):
        self.drafts, self.fail = tuple(drafts), fail
        self.seen: list[list[int]] = []
        self.released: list[str] = []

    def propose(self, request_id, tokens, k):
        self.seen.append(list(tokens))
        if self.fail:
            raise RuntimeError("broken proposer")
        return self.drafts[:k]

    def release(self, request_id):
        self.released.append(request_id)


def core(node_id, proposer=None, max_drafts=3, scheduling=SchedulerLimits()):
    speculation = Speculation(proposer, SpeculationLimits(max_drafts), vocab=CFG.vocab_size) if proposer else None
    return NodeCore(node_id, "llama", CFG, CoreLimits(), scheduling, speculation=speculation)


def of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


def request(max_tokens=20, sampling=SamplingParams(temperature=0)):
    """A request of a 4-token prompt through a, b and c."""
    return dataclasses.replace(spec(max_tokens=max_tokens), sampling=sampling, prompt_tokens=4)


def first_node(proposer, max_tokens=20, sampling=SamplingParams(temperature=0)):
    a = core("a", proposer)
    a.accept_prompt(request(max_tokens, sampling), tokens(1, 2, 3, 4))
    a.queue.queue.clear()  # the prompt's step ran
    return a


def queued(node):
    (item,) = node.queue.queue
    node.queue.queue.clear()
    return item


# -- the first node -------------------------------------------------------------------------------------------
def test_a_returned_token_goes_on_with_proposals_and_its_cache_position():
    proposer = Fixed()
    a = first_node(proposer)
    assert a.accept_activations([Activation("r1", tokens(5))]) == []
    item = queued(a)
    # DraftLength starts at 2 proposals; the token goes at position 4, right after the prompt
    assert item.data.tolist() == [5, 7, 8] and item.proposals == (7, 8) and item.start == 4
    assert proposer.seen == [[1, 2, 3, 4, 5]]
    # one draft accepted (7), then 42 sampled in place of 8: the next token goes at 4 + 1 + 1
    assert a.accept_activations([Activation("r1", tokens(42), start=6)]) == []
    item = queued(a)
    assert proposer.seen[-1] == [1, 2, 3, 4, 5, 7, 42]  # the accepted draft joined the text, the rejected one not
    assert item.start == 6 and item.proposals == (7, 8)  # one accepted of two: propose accepted + 1 = 2


def test_the_first_node_sends_the_proposals_and_start_down_the_ring():
    a = first_node(Fixed())
    a.accept_activations([Activation("r1", tokens(5))])
    (plan,) = a.take_batch()
    (send,) = of(Send, a.step_done(plan, StepOutputs({"r1": hidden(3)})))
    (activation,) = send.activations
    assert send.address == "h:2" and activation.proposals == (7, 8) and activation.start == 4


def test_proposals_stop_at_what_the_request_has_left_and_a_broken_proposer_costs_only_its_proposals():
    a = first_node(Fixed(), max_tokens=3)  # prompt 4 + 3 new: the token at 4 leaves room for 1 draft
    a.accept_activations([Activation("r1", tokens(5))])
    assert queued(a).proposals == (7,)
    broken = first_node(Fixed(fail=True))
    assert broken.accept_activations([Activation("r1", tokens(5))]) == []
    item = queued(broken)
    assert item.data.tolist() == [5] and item.proposals == ()


def test_out_of_vocabulary_proposals_are_dropped():
    a = first_node(Fixed(drafts=(7, CFG.vocab_size)))
    a.accept_activations([Activation("r1", tokens(5))])
    assert queued(a).proposals == ()


def test_a_request_that_opted_out_gets_no_proposals():
    proposer = Fixed()
    a = first_node(proposer, sampling=SamplingParams(temperature=0, speculate=False))
    a.accept_activations([Activation("r1", tokens(5))])
    assert queued(a).proposals == () and proposer.seen == []


def test_a_node_holding_more_requests_than_the_limit_proposes_nothing_until_it_holds_fewer():
    """Beside many decoding requests, draft rows are compute the whole batch pays for: none past the limit."""
    proposer = Fixed()
    a = core("a", proposer)
    a.speculation.limits = SpeculationLimits(3, max_requests=2)
    for rid in ("r1", "r2", "r3"):
        a.accept_prompt(dataclasses.replace(request(), request_id=rid), tokens(1, 2, 3, 4))
    a.queue.queue.clear()
    a.accept_activations([Activation("r1", tokens(5))])
    assert queued(a).proposals == () and proposer.seen == []
    a.end_request("r3", "cancelled")
    a.accept_activations([Activation("r2", tokens(5))])
    assert queued(a).proposals == (7, 8)


def test_the_request_limit_of_speculation_is_a_positive_integer():
    with pytest.raises(ValueError, match="--speculate-max-requests must be an integer >= 1"):
        SpeculationLimits(4, max_requests=0)


def test_ending_a_request_releases_its_proposer_state():
    proposer = Fixed()
    a = first_node(proposer)
    a.end_request("r1", "cancelled")
    assert proposer.released == ["r1"] and not a.speculation.lengths


# -- rollback starts -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("start", [3, 4, 8, 1000], ids=["an accepted position", "before the token", "past", "far"])
def test_a_start_that_would_undo_accepted_positions_or_skip_positions_is_refused(start):
    a = first_node(Fixed())
    a.accept_activations([Activation("r1", tokens(5))])  # positions 4 (token), 5 and 6 (proposals)
    queued(a)
    (refusal,) = a.accept_activations([Activation("r1", tokens(42), start=start)])
    assert "outside [5, 7]" in refusal.reason and not a.queue


def test_a_start_on_a_node_without_proposals_in_flight_must_be_the_cache_end():
    b = core("b")
    assert b.accept_activations([Activation("r1", hidden(4), request())]) == []
    (refusal,) = b.accept_activations([Activation("r1", hidden(1), start=2)])
    assert "outside [4, 4]" in refusal.reason
    assert b.accept_activations([Activation("r1", hidden(1), start=4)]) == []


@pytest.mark.parametrize(
    "fields",
    [{"start": -1}, {"proposals": (-3,), "start": 0}],
    ids=["negative start", "negative proposal"],
)
def test_hostile_starts_and_proposals_are_refused_on_the_wire(fields):
    entry = wire.encode_activation(Activation("r1", tokens(5, 7)))
    for name, value in fields.items():
        if isinstance(value, tuple):
            getattr(entry, name).extend(value)
        else:
            setattr(entry, name, value)
    with pytest.raises(wire.WireError):
        wire.decode_activation(entry, 1 << 20)


def test_proposals_travel_the_wire_and_need_fewer_than_the_rows_and_a_start():
    a = Activation("r1", hidden(3), proposals=(7, 8), start=4)
    back = wire.decode_activation(wire.encode_activation(a), 1 << 20)
    assert back.proposals == (7, 8) and back.start == 4
    entry = wire.encode_activation(Activation("r1", hidden(2)))
    entry.proposals.extend([7, 8])
    entry.start = 4
    with pytest.raises(wire.WireError, match="proposals need more rows"):
        wire.decode_activation(entry, 1 << 20)
    with pytest.raises(ValueError, match="explicit start"):
        Activation("r1", hidden(3), proposals=(7, 8))


# -- the last node -------------------------------------------------------------------------------------------
def last_node(max_tokens=20):
    c = core("c")
    c.accept_activations([Activation("r1", hidden(4), request(max_tokens))])
    (plan,) = c.take_batch()
    (sample,) = of(Sample, c.step_done(plan, StepOutputs({"r1": np.zeros((1, 512), np.float32)})))
    assert sample.drafts == ()
    of(Send, c.sampled({"r1": SampleResult(5)}))  # the first token, at position 4
    c.accept_activations([Activation("r1", hidden(3), proposals=(7, 8), start=4)])
    (plan,) = c.take_batch()
    (sample,) = of(Sample, c.step_done(plan, StepOutputs({"r1": np.zeros((3, 512), np.float32)})))
    return c, sample


def test_the_last_node_verifies_every_row_and_answers_with_the_accepted_tokens():
    c, sample = last_node()
    assert sample.logits.shape == (3, 512) and sample.drafts == (7, 8)
    actions = c.sampled({"r1": [SampleResult(7), SampleResult(42)]})
    (deliver,) = of(Deliver, actions)
    assert [r.token for r in deliver.message.results] == [7, 42] and not deliver.message.finished
    (send,) = of(Send, actions)
    (next_input,) = send.activations
    assert send.address == "h:1" and next_input.data.tolist() == [42] and next_input.start == 6
    assert (c.counters["spec_proposed"], c.counters["spec_accepted"], c.counters["tokens_per_trip_2"]) == (2, 1, 1)


def test_a_stop_token_inside_the_accepted_run_ends_the_answer_there():
    c, _ = last_node()
    actions = c.sampled({"r1": [SampleResult(7), SampleResult(STOP)]})
    (deliver,) = of(Deliver, actions)
    assert [r.token for r in deliver.message.results] == [7, STOP] and deliver.message.finish_reason == "stop"
    assert of(Release, actions) and not of(Send, actions)


def test_max_tokens_inside_the_accepted_run_ends_the_answer_there():
    c, _ = last_node(max_tokens=3)  # 1 generated already: 2 more
    (deliver,) = of(Deliver, c.sampled({"r1": [SampleResult(7), SampleResult(8), SampleResult(9)]}))
    assert [r.token for r in deliver.message.results] == [7, 8] and deliver.message.finish_reason == "length"


def test_a_verification_that_does_not_repeat_the_drafts_fails_the_request():
    c, _ = last_node()
    (deliver,) = of(Deliver, c.sampled({"r1": [SampleResult(8), SampleResult(42)]}))
    assert deliver.message.finish_reason == "error" and "do not verify" in deliver.message.error


# -- the scheduler --------------------------------------------------------------------------------------------
def test_a_chunk_with_proposals_runs_whole_beside_the_decode_rows_and_is_charged_its_positions():
    s = StepScheduler(SchedulerLimits(step_tokens=8))
    s.push(Queued("d", tokens(1)))
    s.push(Queued("p", tokens(1, 7, 8, 9), proposals=(7, 8, 9), start=10))
    s.push(Queued("prompt", tokens(*range(20))))
    (group,) = s.take(lambda rid: Shard("llama", 0, 6, 6))
    by_id = {item.request_id: item for item in group.items}
    assert by_id["p"].data.tolist() == [1, 7, 8, 9] and by_id["p"].start == 10
    assert len(by_id["prompt"].data) == 8 - 1 - 4  # the rest of the budget


def test_a_chunk_with_proposals_larger_than_the_step_budget_runs_alone_never_cut():
    s = StepScheduler(SchedulerLimits(step_tokens=2, prefill_chunk=2))
    s.push(Queued("p", tokens(1, 7, 8, 9), proposals=(7, 8, 9), start=10))
    (group,) = s.take(lambda rid: Shard("llama", 0, 6, 6))
    assert [len(i.data) for i in group.items] == [4] and not s.queue


def test_a_request_reusing_a_finished_requests_cache_looks_proposals_up_in_the_whole_text():
    proposer = Fixed()
    a = first_node(proposer)
    a.accept_activations([Activation("r1", tokens(5))])
    a.end_request("r1", "finished")  # its caches are kept: its text too
    again = dataclasses.replace(request(), request_id="r2", prompt_tokens=7, reuse_from="r1", reuse_positions=5)
    a.accept_prompt(again, tokens(6, 7))  # only the rest of the prompt is sent
    a.queue.queue.clear()
    a.accept_activations([Activation("r2", tokens(9))])
    assert proposer.seen[-1] == [1, 2, 3, 4, 5, 6, 7, 9]
    a.end_request("r2", "failed")  # a failed request's text is not kept
    assert list(a.speculation.kept) == ["r1"]


def test_a_request_that_opted_out_still_leaves_its_text_for_one_reusing_its_cache():
    proposer = Fixed()
    a = first_node(proposer, sampling=SamplingParams(temperature=0, speculate=False))
    a.accept_activations([Activation("r1", tokens(5))])
    assert queued(a).proposals == ()
    a.end_request("r1", "finished")
    again = dataclasses.replace(request(), request_id="r2", prompt_tokens=7, reuse_from="r1", reuse_positions=5)
    a.accept_prompt(again, tokens(6, 7))
    a.queue.queue.clear()
    a.accept_activations([Activation("r2", tokens(9))])
    assert proposer.seen == [[1, 2, 3, 4, 5, 6, 7, 9]]


def test_a_deferred_proposer_is_asked_just_before_the_step_and_its_drafts_join_the_input():
    proposer = Fixed()
    a = core("a", proposer)
    a.speculation.deferred = True  # a draft model: asked off the event loop by the driver, not on arrival
    a.accept_prompt(request(), tokens(1, 2, 3, 4))
    a.queue.queue.clear()
    a.accept_activations([Activation("r1", tokens(5))])
    (plan,) = a.take_batch()
    (item,) = plan.rows
    assert item.data.tolist() == [5] and item.propose == 2 and proposer.seen == []
    asks = a.proposal_asks(plan)
    assert asks == [("r1", [1, 2, 3, 4, 5], 2)]
    (drafts,) = a.speculation.draft(asks)
    (ready,) = a.proposed(plan, {"r1": drafts}).rows
    assert ready.data.tolist() == [5, 7, 8] and ready.proposals == (7, 8) and ready.start == 4
    # the next token may drop those proposals, as if they had been made on arrival
    assert a.accept_activations([Activation("r1", tokens(42), start=5)]) == []
    assert proposer.seen[-1] == [1, 2, 3, 4, 5]


def test_a_deferred_proposer_that_returns_too_many_or_foreign_ids_adds_nothing():
    a = core("a", Fixed(drafts=(7, 8, 9)))
    assert a.speculation.draft([("r1", [1, 2], 2)]) == [(7, 8)]  # Fixed cuts to k itself
    a.speculation.proposer = type("Greedy", (), {"propose": lambda self, r, t, k: (1, 2, 3), "release": print})()
    assert a.speculation.draft([("r1", [1, 2], 2)]) == [()]


@pytest.mark.parametrize("k", [0, 33, 2.5])
def test_the_proposals_per_trip_are_bounded(k):
    with pytest.raises(ValueError, match="--speculate-tokens must be an integer in"):
        SpeculationLimits(k)


def test_the_speculation_flags_reach_the_node_settings_and_nonsense_is_refused_naming_the_flag():
    from tests.unit.test_settings import settings

    node = settings().node
    assert (node.speculate, node.speculation.max_drafts, node.draft_model) == ("lookup", 4, None)
    node = settings("--speculate", "draft", "--draft-model", "/m.gguf", "--speculate-tokens", "6").node
    assert (node.speculate, node.speculation.max_drafts, str(node.draft_model)) == ("draft", 6, "/m.gguf")
    assert settings("--speculate", "off").node.speculate == "off"
    for flags in (["--speculate", "draft"], ["--draft-model", "/m.gguf"]):
        with pytest.raises(ValueError, match="--speculate draft needs --draft-model"):
            settings(*flags)


def test_a_deferred_proposer_prefills_each_prompt_once_its_last_chunk_ran():
    class Prefilling(Fixed):
        def prefill(self, request_id, tokens):
            self.seen.append(("prefill", request_id, list(tokens)))

    proposer = Prefilling()
    a = core("a", proposer)
    a.speculation.deferred = True
    a.accept_prompt(request(), tokens(1, 2, 3, 4))
    (group,) = a.take_batch()
    asks = a.draft_prefills(group)
    assert asks == [("r1", [1, 2, 3, 4])]
    a.speculation.prefill(asks)
    assert proposer.seen == [("prefill", "r1", [1, 2, 3, 4])]
    a.speculation.deferred = False  # proposals made on arrival: nothing to prefill
    assert a.draft_prefills(group) == []


def test_a_batching_proposer_is_asked_in_batches_it_can_hold():
    class Batching(Fixed):
        max_requests = 2

        def propose_batch(self, asks):
            assert len(asks) <= self.max_requests
            self.seen.append([rid for rid, _, _ in asks])
            return [self.drafts[:k] for _, _, k in asks]

    proposer = Batching()
    a = core("a", proposer)
    drafts = a.speculation.draft([(f"r{i}", [1, 2], 2) for i in range(5)])
    assert drafts == [(7, 8)] * 5 and proposer.seen == [["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_the_http_opt_out_is_a_boolean_extension_field_carried_in_the_sampling_parameters():
    from node.http.schema import ApiError, parse_chat

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body).options.sampling.speculate is True
    assert parse_chat(body | {"speculative": False}).options.sampling.speculate is False
    with pytest.raises(ApiError) as e:
        parse_chat(body | {"speculative": "no"})
    assert e.value.status == 400 and e.value.param == "speculative"
    sampling = wire.decode_sampling(wire.encode_sampling(SamplingParams(temperature=0, speculate=False)))
    assert sampling.speculate is False  # and it travels to every node of the plan
