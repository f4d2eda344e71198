"""Who may ask a node to do what: plans name only known members, and each message comes from the node that should
send it.

A plan is the entry node's say-so about where a request's data flows; a node that followed any plan would run the
model for anyone and send activations or answers wherever a stranger asked. So a node takes part in a plan only
when every node it names, and its entry, are members it knows itself, and it sends to them at the addresses it
knows them by (not the plan's: two nodes may know one member by different names). With a
cluster key, gRPC tells the node which member is calling (mutual TLS), and each message must come from its proper
sender: a prompt from the request's entry, activations from the previous node of the plan (the next token from
the last), an end from the entry or a plan member. Without a key there is no caller to check, only the plan.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from node.core.failures import busy
from node.core.plan import PlanError, RequestSpec


def check_plan_members(spec: RequestSpec, members: Mapping[str, str]) -> None:
    """Every node the plan names, and its entry, must be a member this node knows (whether the plan is well formed
    is node/core/plan.py's `check_plan_shape`). `members`: node id -> address of every node this one knows (itself
    included). The plan's addresses are not compared with them: a node sends only to the addresses it knows members
    by (NodeCore._address), so a plan can only name who takes part, never where data goes."""
    for node_id in [step.node_id for step in spec.plan] + [spec.entry_node_id]:
        if node_id not in members:
            # busy, not refused: a node that has just joined may be known to the entry a moment before us.
            raise busy(f"the plan names node {node_id!r}, which is not a member this node knows")


def predecessor(spec: RequestSpec, index: int) -> str:
    """Who sends step `index` its input: the previous node, or for the first node (the next token) the last."""
    return spec.plan[index - 1].node_id if index > 0 else spec.plan[-1].node_id


def check_caller(caller: str | None, allowed: Collection[str], what: str) -> None:
    """`caller` is the authenticated member calling (None without a cluster key: nothing to check)."""
    if caller is not None and caller not in allowed:
        raise PlanError(f"{what} from node {caller!r}, which may not send it")
