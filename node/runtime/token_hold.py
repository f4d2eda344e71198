"""Tokens for the entry's clients wait while a decode pass is due or running on this node's engine, and are handed
on, in order, once it ended and its messages left.

Where the engine fills the cores (a one-core machine, or ggml's threads on every core), handing a token to its HTTP
stream takes a core from the pass that computes the next one: at the first node of a ring, the entry's write sat
between the last node's token and the pass it feeds. Held, the write runs while that pass's activations travel and
the next node computes, when this node would wait anyway. A token waits at most one decode pass (a short one: its
rows are one position each); a prompt chunk never holds tokens (it takes seconds, and the streams beside it would
stutter), and one being computed keeps the hold open.

Order is the invariant: while anything is held, whatever comes later (a failure included) goes behind it, so a
client's stream and its failures reach the entry as they were sent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from node.core.step_plan import StepPlan


class TokenHold:
    def __init__(self) -> None:
        self.held: deque[Callable[[], None]] = deque()
        self.due = False  # activations for a decode pass arrived, and no pass took them yet
        self.running: bool | None = None  # whether the pass on the engine thread is a decode pass (None: no pass)

    @property
    def closed(self) -> bool:
        return self.running is True or (self.due and self.running is None)

    def put(self, deliver: Callable[[], None]) -> None:
        """Hand a token (or a failure) to the entry's client now, unless the hold is closed or holds others."""
        if self.closed or self.held:
            self.held.append(deliver)
        else:
            deliver()

    def arrived(self) -> None:
        """Activations for a decode pass arrived: tokens wait for the pass that runs them."""
        self.due = True

    def started(self, plan: StepPlan) -> None:
        """`plan` went to the engine thread: a decode pass holds tokens until it ends, a prompt chunk releases them."""
        self.due, self.running = False, is_decode(plan)
        if not self.running:
            self.release()

    def ran(self) -> None:
        """A pass the engine thread started by itself on inputs that arrived (a ring's relayed rows) ended. What
        it holds is released once its messages left (`release`, by the caller)."""
        self.due, self.running = False, None

    def ended(self) -> None:
        """The pass ended. What it holds is released once what the pass made is sent (`release`, by the caller)."""
        self.running = None

    def release(self) -> None:
        """Hand on what is held, in order (a delivery that puts more is handed on in this call too)."""
        while self.held:
            self.held.popleft()()

    def idle(self) -> None:
        """No pass is coming (the worker waits for work): nothing is due, and nothing waits."""
        self.due = False
        self.release()


def is_decode(plan: StepPlan) -> bool:
    """Every row one position: a decode step, not a prompt chunk (a row with drafts to verify is short too, but a
    pass of them is left unheld: rare, and their tokens come several at a time)."""
    return all(len(row.data) == 1 for row in plan.rows)
