"""The node core's KV cache memory, driven with plain values: each request reserves the cache its prompt and new
tokens need, and one that does not fit now is refused as busy, one that can never fit for good."""

from node.core.actions import Deliver
from node.core.failures import Failure, FailureKind
from node.core.requests import Activation, Refusal
from shards.model.shard import Shard
from tests.support.factories import CFG, hidden, spec
from tests.unit.test_core import core, of, sized


def test_each_request_reserves_its_kv_cache_and_one_that_does_not_fit_is_refused_as_busy():
    per_position = 2 * 2 * CFG.n_kv_heads * CFG.head_dim * 4  # node b holds 2 layers; key + value, float32
    b = core("b", kv_budget=300 * per_position, kv_entry_share=1.0)  # one entry's share: test_memory_bounds.py
    assert b.kv_bytes(Shard("llama", 2, 4, 6), 1) == per_position
    assert b.accept_activations([Activation("r1", hidden(), sized("r1", 100, 100))]) == []
    assert b.kv_reserved == 200 * per_position
    (refusal,) = b.accept_activations([Activation("r2", hidden(), sized("r2", 100, 50))])  # 200 + 150 > 300
    assert (
        refusal.failure.kind is FailureKind.BUSY
        and "KV cache memory is full" in refusal.reason
        and "r2" not in b.requests
    )
    b.end_request("r1", "finished")
    assert b.kv_reserved == 0 and b.accept_activations([Activation("r2", hidden(), sized("r2", 100, 50))]) == []


def test_a_request_beyond_the_models_context_is_refused_for_good():
    """Prompt plus new tokens past max_position_embeddings (256 here): no cache is ever sized for it."""
    (refusal,) = core("b").accept_activations([Activation("r1", hidden(), sized("r1", 200, 57))])
    assert refusal.failure.kind is FailureKind.REFUSED and "exceed the model's context of 256" in refusal.reason


def test_a_request_larger_than_the_whole_kv_budget_is_refused_for_good():
    b = core("b", kv_budget=10_000)
    (refusal,) = b.accept_activations([Activation("r1", hidden(), sized("r1", 100, 100))])
    assert refusal.failure.kind is FailureKind.REFUSED and "more than its budget" in refusal.reason


def test_a_busy_refusal_downstream_reaches_the_entry_as_busy():
    b = core("b")
    b.accept_activations([Activation("r1", hidden(), spec())])
    (deliver,) = of(Deliver, b.refused("h:3", [Refusal("r1", Failure(FailureKind.BUSY, "KV cache memory is full"))]))
    assert deliver.message.failure.kind is FailureKind.BUSY
