"""A pass's decode rows sent on by the engine thread as the pass ends (hidden rows to the next node; on a ring's last
shard the token back to the first node, which is its entry, with its delivery), before the event loop hears of the
pass (`Row.to`, node/core/step_plan.py): the hop's message then leaves without the loop's wake, the
core's routing and the transport call, which cost most of a hop's time outside the link on a core whose caches the
pass has just filled with weights (node/runtime/overhead.py's `hop_out`).

The core decides: it names a row's destination only where its message would be the one written here
(node/core/node_core.py `_route`), with the rule under which a token goes on (`Row.back`: it is neither a stop token
nor the last the request may have), and routes every row not written here (`StepOutputs.sent`).
The rows to write are checked as `step_done` checks every row (`malformed_outputs`) before any is: one bad row and
none is written, and the core fails them. Order: a request's next output exists only once its last message went
round the ring, so a message written here never overtakes one of the same request still on the loop's way; across
requests order means nothing. A request that ended while the pass ran may still have its message written: the next
node drops it as any late message (the end reaches it too).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping

import numpy as np

from node.core.requests import Activation, Refusal, TokenMessage
from node.core.step_plan import Sampled, StepPlan
from node.runtime.engine_step import Executed, Written
from shards.decoding.sampling import SampleResult
from shards.formats.config import ModelConfig

log = logging.getLogger(__name__)

# A last shard's rule (`Row.back`) counts the request's tokens as the core knew them when it planned the row, which may
# be one pass short: the token sent from here reaches the first node, and its next input can come back and be planned,
# before the loop applied the pass that sampled it (never two: the engine thread hands that pass to the loop before it
# runs the next). So a request's last STALE_PASSES + 1 tokens are left to the core, which counts them exactly.
STALE_PASSES = 1

Write = Callable[[str, tuple[Activation, ...], tuple[TokenMessage, ...]], Callable[[], Awaitable[list[Refusal]]] | None]


class EarlySend:
    """`rows(plan, outputs, samples)`, on the engine thread as a pass ends (node/runtime/engine_step.py `run_pass`,
    before the pass's records are made): its rows with a `to` written there, one message per address, through
    `write` (the transport's `write_now`: None where it can't write without the loop); what was written comes back
    (`StepOutputs.sent`, `Executed.written`). `__call__(done)` does the same for a pass already recorded. Never
    raises: what it could not write, the core routes."""

    def __init__(self, config: ModelConfig, write: Write, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"a message's room is positive, got {max_bytes} bytes")
        self.config, self.write, self.max_bytes = config, write, max_bytes

    def __call__(self, done: Executed) -> Executed:
        sent, written = self.rows(done.plan, done.outputs.outputs, done.outputs.samples)
        if not written:
            return done
        return dataclasses.replace(
            done, outputs=dataclasses.replace(done.outputs, sent=sent), written=(*done.written, *written)
        )

    def rows(
        self, plan: StepPlan, outputs: Mapping[str, np.ndarray | None], samples: Mapping[str, Sampled]
    ) -> tuple[frozenset[str], tuple[Written, ...]]:
        """The requests whose output was written, and the messages written (none: nothing)."""
        if not any(r.to is not None for r in plan.rows):
            return frozenset(), ()
        try:
            return self._sent(plan, outputs, samples)
        except Exception:  # a bug: the core routes the rows as it would without this
            log.exception("writing a pass's messages from the engine thread failed")
            return frozenset(), ()

    def _sent(
        self, plan: StepPlan, outputs: Mapping[str, np.ndarray | None], samples: Mapping[str, Sampled]
    ) -> tuple[frozenset[str], tuple[Written, ...]]:
        """A pass whose rows to send are all as `step_done` wants them (float32 [1, hidden], or [1, vocab] logits
        where the engine did not pick the token; finite: a sum that is not has a value that is not, or values too
        large to sum, which the core's own check then judges) has them written; any other has none (the core fails
        or routes them). A last shard's row goes back only with a token that goes on (`Row.back`), and not among the
        request's last tokens (STALE_PASSES)."""
        width = self.config.vocab_size if plan.shard.is_last else self.config.hidden_size
        by_address: dict[str, tuple[list[Activation], list[TokenMessage]]] = {}
        total = 0.0
        for row in plan.rows:
            if row.to is None or (rid := row.request_id) not in outputs:
                continue
            if (out := outputs[rid]) is not None:
                if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (1, width):
                    return frozenset(), ()
                total += float(out.sum())
            if row.back is None and out is not None:
                by_address.setdefault(row.to, ([], []))[0].append(Activation(rid, out))
            elif row.back is not None and isinstance(got := samples.get(rid), SampleResult):
                if not row.back.ends(got.token) and row.back.left > 1 + STALE_PASSES:
                    activations, messages = by_address.setdefault(row.to, ([], []))
                    activations.append(Activation(rid, np.array([got.token], dtype=np.int64)))
                    messages.append(TokenMessage(rid, (got,)))
        if not math.isfinite(total):
            return frozenset(), ()
        written: list[Written] = []
        for address, (activations, messages) in by_address.items():
            if sum(a.data.nbytes for a in activations) > self.max_bytes:
                continue
            if (answer := self.write(address, tuple(activations), tuple(messages))) is not None:
                written.append(Written(address, tuple(activations), answer, time.perf_counter(), tuple(messages)))
        return frozenset(a.request_id for w in written for a in w.activations), tuple(written)
