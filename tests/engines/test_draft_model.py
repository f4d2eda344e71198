"""The draft model proposer: its drafts are the draft model's own greedy continuation, whatever its cache held
before (rollback to the common prefix is exact), and every cache is freed on release or eviction; a draft model with
another vocabulary is refused. On the tiny fixture models, on numpy and ggml."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from shards.decoding.draft_model import DraftModelError, DraftModelProposer, common_prefix
from shards.engines.registry import engine_class, installed
from shards.formats.loader import load_config
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import generate
from tests.conftest import FIXTURES

DRAFT = FIXTURES / "llama"  # 6 layers, vocabulary 512
ENGINES = [e for e in ("numpy", "ggml") if e in installed()]


@pytest.fixture(params=ENGINES)
def engine_name(request):
    return request.param


def engine(name: str, path=DRAFT):
    cfg = load_config(path)
    return engine_class(name)(path, Shard.whole("draft", cfg.n_layers), cfg)


@functools.cache
def reference(name: str):
    return engine(name)


def continuation(name: str, tokens, k: int) -> tuple[int, ...]:
    """The draft model's greedy continuation by plain generation (on an engine of its own, which generate leaves
    without caches)."""
    return tuple(r.token for r in generate([reference(name)], tokens, k))


PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 512, 20)]


def test_drafts_are_the_models_own_greedy_continuation(engine_name):
    proposer = DraftModelProposer(engine(engine_name))
    assert proposer.propose("r", PROMPT, 6) == continuation(engine_name, PROMPT, 6)
    assert proposer.propose("r", PROMPT, 0) == ()


def test_after_accepted_and_rejected_drafts_the_next_proposal_is_as_from_a_fresh_cache(engine_name):
    proposer = DraftModelProposer(engine(engine_name))
    drafts = proposer.propose("r", PROMPT, 5)
    # the target accepted two drafts and then chose another token; then a replay sends a shorter, divergent text
    for tokens in (PROMPT + list(drafts[:2]) + [(drafts[2] + 1) % 512], PROMPT + list(drafts), PROMPT[:12] + [7, 8]):
        assert proposer.propose("r", tokens, 4) == continuation(engine_name, tokens, 4)
        assert proposer.engine.cache_length("r") == len(tokens) + 3  # the last draft is never fed


def test_release_frees_the_cache_and_at_most_max_requests_are_kept(engine_name):
    proposer = DraftModelProposer(engine(engine_name), max_requests=2)
    for rid in "abc":
        proposer.propose(rid, PROMPT, 2)
    assert len(proposer) == 2 and proposer.engine.active_requests == 2  # "a" was evicted, its cache freed
    assert proposer.propose("a", PROMPT, 3) == continuation(engine_name, PROMPT, 3)  # and re-fed from scratch
    for rid in "ab":
        proposer.release(rid)
    proposer.release("never-seen")
    assert len(proposer) == 1 and proposer.engine.active_requests == 1
    proposer.close()  # releases the rest
    assert len(proposer) == 0 and proposer.engine.active_requests == 0


def test_the_end_of_the_draft_models_context_shortens_the_proposal():
    proposer = DraftModelProposer(engine("numpy"))
    context = proposer.engine.config.max_position_embeddings
    assert len(proposer.propose("r", [1] * (context - 2), 5)) == 2
    assert proposer.propose("r", [1] * context, 5) == ()


def test_a_failed_step_releases_the_request_so_the_next_proposal_starts_afresh():
    proposer = DraftModelProposer(engine("numpy"))
    proposer.propose("r", PROMPT, 2)
    with pytest.raises(ValueError, match="out of range"):
        proposer.propose("r", PROMPT + [512], 2)
    assert len(proposer) == 0 and proposer.engine.active_requests == 0
    assert proposer.propose("r", PROMPT, 2) == continuation("numpy", PROMPT, 2)


def test_load_takes_a_gguf_or_a_folder_and_checks_the_vocabulary():
    target = load_config(FIXTURES / "qwen2")
    proposer = DraftModelProposer.load(DRAFT, target, engine="numpy")
    assert proposer.propose("r", PROMPT, 3) == continuation("numpy", PROMPT, 3)
    gguf = DraftModelProposer.load(FIXTURES / "gguf" / "llama.gguf", target, engine="numpy")
    assert len(gguf.propose("r", PROMPT, 3)) == 3


def test_a_draft_model_with_another_vocabulary_is_refused_naming_both_sizes():
    target = load_config(FIXTURES / "qwen2")
    bigger = type(target)(**{**target.__dict__, "vocab_size": 49152})
    with pytest.raises(DraftModelError, match="512 tokens, the served model 49152"):
        DraftModelProposer.load(DRAFT, bigger, engine="numpy")


def test_a_draft_model_with_another_tokenizer_of_the_same_size_is_refused():
    target = load_config(FIXTURES / "llama")  # the same vocab_size, 512; the tokenizer a SentencePiece one
    spm = Tokenizer.load(FIXTURES / "gguf" / "spm.gguf")
    with pytest.raises(DraftModelError, match="another tokenizer"):
        DraftModelProposer.load(DRAFT, target, engine="numpy", target_tokenizer=spm)
    DraftModelProposer.load(DRAFT, target, engine="numpy", target_tokenizer=Tokenizer.load(DRAFT))


def test_a_shard_is_not_a_draft_model():
    cfg = load_config(DRAFT)
    with pytest.raises(DraftModelError, match="whole"):
        DraftModelProposer(engine_class("numpy")(DRAFT, Shard("d", 0, 3, cfg.n_layers), cfg))


@pytest.mark.parametrize("a, b, n", [([], [1], 0), ([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2), ([5], [6], 0)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n


def test_a_batch_of_proposals_equals_each_proposed_alone(engine_name):
    texts = {"a": PROMPT, "b": PROMPT[:7], "c": PROMPT[3:] + [1, 2, 3], "d": PROMPT[:5]}
    ks = {"a": 4, "b": 1, "c": 3, "d": 0}
    batched = DraftModelProposer(engine(engine_name))
    got = batched.propose_batch([(rid, texts[rid], ks[rid]) for rid in texts])
    assert got == [continuation(engine_name, texts[rid], ks[rid]) if ks[rid] else () for rid in texts]
    # again, after each text grew by an accepted draft and another token: rolled back and caught up together
    grown = {rid: texts[rid] + list(got[i][:1]) + [9] for i, rid in enumerate(texts)}
    again = batched.propose_batch([(rid, grown[rid], 2) for rid in texts])
    assert again == [continuation(engine_name, grown[rid], 2) for rid in texts]


def test_a_batch_with_a_request_twice_is_refused():
    proposer = DraftModelProposer(engine("numpy"))
    with pytest.raises(ValueError, match="twice"):
        proposer.propose_batch([("a", PROMPT, 2), ("a", PROMPT, 2)])
    assert len(proposer) == 0


def test_beyond_max_requests_the_requests_holding_a_cache_are_drafted_and_the_others_get_nothing():
    proposer = DraftModelProposer(engine("numpy"), max_requests=2)
    proposer.propose("c", PROMPT, 2)
    got = proposer.propose_batch([(rid, PROMPT, 2) for rid in "abc"])
    assert got == [continuation("numpy", PROMPT, 2), (), continuation("numpy", PROMPT, 2)]
    assert len(proposer) == 2 and proposer.engine.active_requests == 2


def test_a_prefilled_prompt_is_not_fed_again_and_drafts_are_unchanged(engine_name):
    proposer = DraftModelProposer(engine(engine_name))
    proposer.prefill("r", PROMPT)
    assert proposer.engine.cache_length("r") == len(PROMPT)
    proposer.prefill("r", PROMPT)  # nothing new: nothing fed, nothing rolled back
    assert proposer.engine.cache_length("r") == len(PROMPT)
    first = continuation(engine_name, PROMPT, 1)
    assert proposer.propose("r", PROMPT + list(first), 3) == continuation(engine_name, PROMPT + list(first), 3)
    proposer.release("r")
    assert proposer.engine.active_requests == 0


def test_a_long_text_is_fed_in_chunks_with_the_same_drafts(engine_name):
    proposer = DraftModelProposer(engine(engine_name))
    proposer.chunk = 6  # PROMPT's 20 tokens in 4 steps
    assert proposer.propose("r", PROMPT, 4) == continuation(engine_name, PROMPT, 4)
    assert proposer.propose_batch([("a", PROMPT[:13], 2), ("b", PROMPT[:3], 2)]) == [
        continuation(engine_name, PROMPT[:13], 2),
        continuation(engine_name, PROMPT[:3], 2),
    ]
