"""PNG plots of the benchmarks' results (matplotlib: the `bench` dependency group, never a runtime dependency).

uv run --group bench python -m bench.bench_cluster     # writes bench/plots/concurrency.png and nodes.png
uv run --group bench python -m bench.bench_engine --engine numpy,tinygrad,mlx   # bench/plots/engines.png
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PLOTS = Path(__file__).resolve().parent / "plots"
COLORS = ["#2f6fde", "#d9480f", "#2b8a3e", "#862e9c"]


def require() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("plots need matplotlib: run with `uv run --group bench ...` (or pass --no-plot)") from None


def _pyplot():
    require()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _save(fig, path: Path, data) -> Path:
    """The PNG, and beside it the numbers it was drawn from (PATH.json), so a plot can be checked or redrawn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    path.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    return path


def machine_note() -> str:
    threads = os.environ.get("OPENBLAS_NUM_THREADS")
    note = "one 2-core machine"
    return note + (f", {threads} BLAS thread{'s' if threads != '1' else ''} per process" if threads else "")


def concurrency(sweeps: dict[int, list[dict]], path: Path, title: str) -> Path:
    """sweeps: nodes -> [{"streams", "tok_s", "p50_ms", "p99_ms"}]: aggregate tok/s and inter-token latency."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for (nodes, rows), color in zip(sorted(sweeps.items()), COLORS):
        streams = [r["streams"] for r in rows]
        label = f"{nodes} node" + ("s" if nodes > 1 else "")
        left.plot(streams, [r["tok_s"] for r in rows], "o-", color=color, label=label)
        right.plot(streams, [r["p99_ms"] for r in rows], "o-", color=color, label=f"{label}, p99")
        right.plot(streams, [r["p50_ms"] for r in rows], "o--", color=color, alpha=0.6, label=f"{label}, p50")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(streams, [str(s) for s in streams])
        ax.set_xlabel("concurrent streams")
        ax.grid(alpha=0.3)
        ax.legend(frameon=False)
    left.set_ylabel("aggregate tok/s")
    left.set_ylim(bottom=0)
    right.set_ylabel("inter-token latency (ms)")
    right.set_ylim(bottom=0)
    fig.suptitle(title)
    return _save(fig, path, {"title": title, "sweeps": sweeps})


def engines(results: dict[str, dict[str, float]], path: Path, title: str) -> Path:
    """results: engine -> {measure: tok/s}, as grouped bars per measure."""
    plt = _pyplot()
    measures = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(results)
    for i, ((engine, values), color) in enumerate(zip(results.items(), COLORS)):
        xs = [m + (i - (len(results) - 1) / 2) * width for m in range(len(measures))]
        bars = ax.bar(xs, [values[m] for m in measures], width, color=color, label=engine)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    ax.set_xticks(range(len(measures)), measures)
    ax.set_ylabel("tok/s (log scale)")
    ax.set_yscale("log")
    ax.legend(frameon=False)
    ax.set_title(title)
    return _save(fig, path, {"title": title, "engines": results})


def nodes(results: list[dict], path: Path, title: str) -> Path:
    """results: [{"nodes", "one": tok/s of one stream, "eight": aggregate tok/s of 8 streams}]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    counts = [r["nodes"] for r in results]
    ax.plot(counts, [r["one"] for r in results], "o-", color=COLORS[0], label="one stream")
    ax.plot(counts, [r["eight"] for r in results], "o-", color=COLORS[1], label="8 streams (aggregate)")
    ax.set_xticks(counts)
    ax.set_xlabel("nodes (layers split evenly, all on one machine)")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    ax.set_title(title)
    return _save(fig, path, {"title": title, "nodes": results})
