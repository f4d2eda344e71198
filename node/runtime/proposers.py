"""Where a node's proposals come from (`--speculate`): prompt lookup in each request's own tokens, a draft model
the node loads from `--draft-model`, or none. The proposals are made where a request's plan starts
(node/core/speculation.py); the model's own output never depends on them, only how many tokens a trip brings."""

from __future__ import annotations

from node.runtime.settings import NodeSettings, ServedModel
from shards.decoding.speculation import PromptLookup, Proposer


def proposer_for(settings: NodeSettings, model: ServedModel) -> Proposer | None:
    """The proposer `settings` ask for, for the served `model` (None: `--speculate off`)."""
    if settings.speculate == "off":
        return None
    if settings.speculate == "lookup":
        return PromptLookup()
    from shards.decoding.draft_model import DraftModelProposer  # loads an engine: only for nodes that ask for it

    # a draft model is chosen small and fast: on ggml it runs on the blocks its file stores, never requantized up
    options = {"quantize": "none"} if settings.engine == "ggml" else {}
    return DraftModelProposer.load(
        settings.draft_model, model.config, engine=settings.engine, target_tokenizer=model.tokenizer, **options
    )
