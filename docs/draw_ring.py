"""Draws docs/request-ring.png: one request's trip around the ring of nodes.

    uv run --group bench python docs/draw_ring.py [--out docs/request-ring.png]

The picture is the one docs/architecture.md tells in words: a client calls the entry node's HTTP API; the entry
tokenizes the prompt, fixes the plan (which node runs which layers) and sends the token ids to the first shard;
activations go from shard to shard over gRPC; the last shard samples the next token and sends it to the entry
(streamed to the client) and to the first shard (the next step's input). The layer ranges are those of SmolLM2's
30 layers split evenly over three nodes. matplotlib is only in the `bench` dependency group, like the plots in
bench/.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_name("request-ring.png")

# name, detail lines, angle on the ring (degrees), face colour
NODES = (
    ("entry node", "the HTTP API;\ntokenizes, plans,\nstreams tokens out", 90, "#dbe9f6"),
    ("node 1", "layers 0-9\n(embedding + blocks)", 0, "#e3f1dc"),
    ("node 2", "layers 10-19", -90, "#e3f1dc"),
    ("node 3 (last)", "layers 20-29\nnorm + head,\nsamples the token", 180, "#fbe5cf"),
)
RADIUS = 3.4
BOX_W, BOX_H = 2.7, 1.65
# (from, to, label, label offset (dx, dy) from the arc's middle)
HOPS = (
    (0, 1, "prompt: token ids\n+ the plan (gRPC)", (1.1, 0.75)),
    (1, 2, "activations\n(gRPC)", (1.05, -0.55)),
    (2, 3, "activations\n(gRPC)", (-1.05, -0.55)),
    (3, 0, "sampled token\n(gRPC)", (0.75, -0.55)),
)


def centre(i: int) -> tuple[float, float]:
    angle = math.radians(NODES[i][2])
    return RADIUS * math.cos(angle), RADIUS * math.sin(angle)


def draw_box(ax, xy: tuple[float, float], title: str, detail: str, *, colour: str, width: float = BOX_W) -> None:
    x, y = xy
    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - BOX_H / 2),
            width,
            BOX_H,
            boxstyle="round,pad=0.05,rounding_size=0.15",
            facecolor=colour,
            edgecolor="#333333",
            linewidth=1.4,
            zorder=3,
        )
    )
    ax.text(x, y + BOX_H / 2 - 0.28, title, ha="center", va="center", fontsize=13, fontweight="bold", zorder=4)
    ax.text(x, y - 0.22, detail, ha="center", va="center", fontsize=10, linespacing=1.25, zorder=4)


def arrow(ax, start, end, *, rad: float, style: str = "-", colour: str = "#1f4e79", width: float = 2.0) -> None:
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            connectionstyle=f"arc3,rad={rad}",
            arrowstyle="-|>",
            mutation_scale=22,
            linewidth=width,
            linestyle=style,
            color=colour,
            shrinkA=4,
            shrinkB=4,
            zorder=2,
        )
    )


def edge_point(i: int, towards: tuple[float, float]) -> tuple[float, float]:
    """Where the line from node i's centre towards a point leaves its box (so arrows meet the boxes' edges)."""
    x, y = centre(i)
    dx, dy = towards[0] - x, towards[1] - y
    scale = min((BOX_W / 2 + 0.08) / abs(dx) if dx else math.inf, (BOX_H / 2 + 0.08) / abs(dy) if dy else math.inf)
    return x + dx * scale, y + dy * scale


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 8.2), dpi=110)
    ax.set_xlim(-9.0, 5.6)
    ax.set_ylim(-5.1, 5.6)
    ax.set_aspect("equal")
    ax.axis("off")

    for i, (title, detail, _, colour) in enumerate(NODES):
        draw_box(ax, centre(i), title, detail, colour=colour)

    for a, b, label, (lx, ly) in HOPS:
        ca, cb = centre(a), centre(b)
        arrow(ax, edge_point(a, cb), edge_point(b, ca), rad=-0.32)
        mx, my = (ca[0] + cb[0]) / 2, (ca[1] + cb[1]) / 2
        ax.text(
            mx + lx,
            my + ly,
            label,
            ha="center",
            va="center",
            fontsize=10.5,
            color="#1f4e79",
            bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none"),
            zorder=5,
        )

    # the last shard also hands the token to the first shard: the next decode step's input
    last, first = centre(3), centre(1)
    arrow(
        ax,
        (last[0] + BOX_W / 2 + 0.1, last[1] - 0.3),
        (first[0] - BOX_W / 2 - 0.1, first[1] - 0.3),
        rad=0.0,
        style="--",
        colour="#b05a00",
        width=1.6,
    )
    ax.text(
        0,
        -0.95,
        "the same token to the first\nshard: the next step's input",
        ha="center",
        va="center",
        fontsize=9.5,
        color="#b05a00",
        zorder=5,
    )

    # the client, outside the ring
    client = (-7.0, 3.4)
    draw_box(ax, client, "client", "curl, the openai client,\nthe web page", colour="#eeeeee", width=2.9)
    entry = centre(0)
    arrow(
        ax,
        (client[0] + 1.5, client[1] + 0.35),
        (entry[0] - BOX_W / 2 - 0.1, entry[1] + 0.35),
        rad=0.0,
        colour="#444444",
        width=1.8,
    )
    arrow(
        ax,
        (entry[0] - BOX_W / 2 - 0.1, entry[1] - 0.35),
        (client[0] + 1.5, client[1] - 0.35),
        rad=0.0,
        colour="#444444",
        width=1.8,
    )
    ax.text((client[0] + entry[0]) / 2 - 0.2, entry[1] + 0.6, "POST /v1/chat/completions", ha="center", fontsize=10)
    ax.text((client[0] + entry[0]) / 2 - 0.2, entry[1] - 0.75, "tokens streamed back (SSE)", ha="center", fontsize=10)

    ax.text(-1.8, 5.3, "One request around the ring", ha="center", fontsize=16, fontweight="bold")
    ax.text(
        -8.6,
        -4.75,
        "Every node batches the rows of all requests it serves into one forward pass.\n"
        "A lost node: the entry replays the request on a new plan over the nodes still alive.",
        ha="left",
        va="center",
        fontsize=9.5,
        color="#444444",
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight", facecolor="white")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
