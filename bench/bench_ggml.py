"""The ggml engine against llama.cpp on the same GGUF files and thread counts, plus its memory (bench/ggml_memory.py),
its per-step Python cost, a 3-node pipeline and its agreement with llama.cpp and with float32 math (numpy engine).

    uv run python -m bench.bench_ggml --llama-python /tmp/llamavenv/bin/python [--rounds 3] [--threads 1,2]
                                      [--only speed,...] [--models smollm2-q4_1,...] [--out bench-ggml.json]

Models: SmolLM2-135M-Instruct Q4_1 (packaged) and bench's random 357.6M Llama as Q8_0 and Q4_0 GGUFs
(bench/ggml_models.py). llama.cpp runs through bench/llamacpp_ref.py in its own venv (see there). Every speed figure
comes from a fresh process; ours and llama.cpp's alternate round by round (the machine may be shared, so compare
rounds, not absolute numbers), and the load average is recorded with each. Figures go to --out as JSON and to
stdout as markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.ggml_harness import engine, load, ours, theirs
from bench.ggml_memory import memory, ours_memory
from shards.engines.base import StepInput
from shards.formats.loader import load_config

TEXTS = [  # varied text for teacher-forced agreement: prose, dialogue, code, numbers, lists, French, a recipe
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden press adapted from wine making. Within a few decades printers had "
    "spread across Europe, books became cheaper, and ideas travelled faster than ever before. Scholars argue about "
    "how much of the Reformation and the scientific revolution the press made possible, but few doubt that it "
    "changed who could read, and what they could read about.",
    '"Are you coming to the market tomorrow?" asked Maria. "Only if it stops raining," her brother replied, '
    'looking at the grey sky. "Last week the tomatoes were half the price, and the baker gave us an extra loaf."',
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    out, i, j = [], 0, 0\n    while i < len(a) and "
    "j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            "
    "out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\nprint(merge_sorted([1, 4, 9], [2, 3, 10]))\n",
    "Quarterly results: revenue rose 12.4% to $3.82 billion, operating margin was 18.1%, and the company expects "
    "2025 earnings per share between $4.10 and $4.35. Shares closed at 127.56, up 3.2 percent.",
    "Packing list for a weekend hike:\n- water filter and two bottles\n- rain jacket\n- map, compass, headlamp\n"
    "- first-aid kit\n- food for three days: oats, nuts, dried fruit, cheese\n",
    "La tour Eiffel a été construite pour l'Exposition universelle de 1889. Elle mesure aujourd'hui 330 mètres et "
    "reste l'un des monuments les plus visités au monde.",
    "To make a simple tomato sauce, warm olive oil in a pan, add a chopped onion and two cloves of garlic, cook "
    "until soft, then add crushed tomatoes, salt and a pinch of sugar. Simmer for twenty minutes and finish with "
    "fresh basil.",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Give me two tips for learning a new language.",
]


MODEL_NAMES = ("smollm2-q4_1", "random357m-q8_0", "random357m-q4_0")


def model_paths() -> dict[str, Path]:
    from bench.ggml_models import random_gguf
    from shards.formats.packaged import resolve_model

    return {
        "smollm2-q4_1": resolve_model("smollm2")[0],
        "random357m-q8_0": random_gguf("q8_0"),
        "random357m-q4_0": random_gguf("q4_0"),
    }


# -- ours, in a fresh process: python -m bench.bench_ggml --ours speed MODEL THREADS ------------------------------
def ours_speed(path: Path, threads: int) -> dict:
    """The llama.cpp harness's protocol on the engine interface (median decode step, best warm prefill)."""
    e, rng = engine(path, threads), np.random.default_rng(0)
    hi = min(e.config.vocab_size, 20000)
    e.forward([StepInput("a", tokens=rng.integers(100, hi, 64), max_positions=2048)])
    tok, steps = 100, []
    for _ in range(64):
        t0 = time.perf_counter()
        out = e.forward([StepInput("a", tokens=np.array([tok]))])[0]
        tok = int(out[-1].argmax())
        steps.append(time.perf_counter() - t0)
    result = {"decode1": 1 / statistics.median(steps)}
    for n in (8, 16):  # n streams, each a 64-token context, then 32 steps of n rows
        ids = [f"s{n}.{i}" for i in range(n)]
        outs = e.forward([StepInput(r, tokens=rng.integers(100, hi, 64), max_positions=2048) for r in ids])
        toks, steps = [int(o[-1].argmax()) for o in outs], []
        for _ in range(32):
            t0 = time.perf_counter()
            outs = e.forward([StepInput(r, tokens=np.array([t])) for r, t in zip(ids, toks)])
            toks = [int(o[-1].argmax()) for o in outs]
            steps.append(time.perf_counter() - t0)
        result[f"decode{n}"] = n / statistics.median(steps)
        for r in ids:
            e.release(r)
    times = []
    for k in range(4):
        prompt = np.random.default_rng(k).integers(100, hi, 256)
        t0 = time.perf_counter()
        e.forward([StepInput(f"p{k}", tokens=prompt, max_positions=2048)])
        times.append(time.perf_counter() - t0)
        e.release(f"p{k}")
    result["prefill256"] = 256 / min(times[1:])
    result |= python_cost(e)
    return result


def python_cost(e) -> dict:
    """Per-step Python time with the computation itself stubbed out (graphs already built), and what building a
    new graph costs (an 8-request decode shape, not computed)."""
    import ggml.ggml as g

    from shards.engines.ggml.graph import Graph

    ids = [f"c{i}" for i in range(8)]
    e.forward([StepInput(r, tokens=np.arange(8), max_positions=2048) for r in ids])
    compute, out = g.ggml_backend_graph_compute, {}
    g.ggml_backend_graph_compute = lambda backend, gf: 0
    try:
        for n in (1, 8):  # 100 steps each: the requests stay within one span (no new graph in the loop)
            batch = [StepInput(r, tokens=np.array([5])) for r in ids[:n]]
            e.forward(batch)  # builds its graph
            t0 = time.perf_counter()
            for _ in range(100):
                e.forward(batch)
            out[f"python_us_b{n}"] = (time.perf_counter() - t0) / 100 * 1e6
    finally:
        g.ggml_backend_graph_compute = compute
    steps = [StepInput(r, tokens=np.array([5])) for r in ids]
    shape = e.runner.shape(e.pack(steps), [e.caches[r] for r in ids], False)
    t0 = time.perf_counter()
    Graph(e.ops, e.model, shape, e.pool, first=True, hidden=e.config.hidden_size).free()
    out["graph_build_ms_b8"] = (time.perf_counter() - t0) * 1e3
    return out


def ours_top(path: Path, tokens: list[int], name: str, out: str) -> dict:
    """Teacher-forced top-5 ids and logits per position (the llama.cpp harness's `logits`)."""
    from shards.reference.generate import chain_forward

    rows = chain_forward([engine(path, os.cpu_count() or 1, name=name)], "r", np.array(tokens), all_logits=True)
    top = np.argsort(-rows, axis=-1)[:, :5]
    np.savez(out, ids=top, values=np.take_along_axis(rows, top, axis=-1))
    return {"positions": len(tokens)}


def ours_greedy(path: Path, tokens: list[int], n: int, name: str, eos: list[int]) -> dict:
    from shards.reference.generate import generate

    return {
        "tokens": [
            r.token for r in generate([engine(path, os.cpu_count() or 1, name=name)], tokens, n, eos_ids=frozenset(eos))
        ]
    }


# -- the driver -------------------------------------------------------------------------------------------------------
def speed_rounds(models: dict[str, Path], threads: list[int], rounds: int, llama: str) -> list[dict]:
    rows = []
    for r in range(rounds):
        for name, path in models.items():
            for t in threads:
                row = {"round": r, "model": name, "threads": t, "load": load()}
                row["ours"] = ours("speed", path, t)
                row["llama"] = theirs(llama, "speed", path, "--threads", t)
                if name.endswith("q4_0"):  # llama.cpp repacks Q4_0 by default; also without, as exo-node runs
                    row["llama_plain"] = theirs(llama, "speed", path, "--threads", t, "--no-extra-bufts")
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def agreement(models: dict[str, Path], llama: str, work: Path) -> dict:
    from shards.formats.tokenizer import Tokenizer

    out = {}
    for name, path in models.items():
        cfg = load_config(path)
        if name.startswith("smollm2"):
            tok = Tokenizer.load(path)
            tokens = [t for text in TEXTS for t in tok.encode(text)][:1000]
        else:
            tokens = np.random.default_rng(7).integers(3, cfg.vocab_size, 600).tolist()
        ids = work / f"{name}.json"
        ids.write_text(json.dumps(tokens))
        theirs(llama, "logits", path, "--threads", os.cpu_count(), "--tokens", ids, "--out", work / f"{name}-llama.npz")
        for engine_name in ("ggml", "numpy"):
            ours("top", path, ids, engine_name, work / f"{name}-{engine_name}.npz")
        top = {k: np.load(work / f"{name}-{k}.npz") for k in ("llama", "ggml", "numpy")}

        def agree(a: str, b: str) -> dict:
            same = top[a]["ids"][:, 0] == top[b]["ids"][:, 0]
            margin = top[b]["values"][:, 0] - top[b]["values"][:, 1]  # b's lead of its top token
            return {
                "positions": len(same),
                "agree": float(same.mean()),
                "disagreements_margins": sorted(np.round(margin[~same], 4).tolist()),
            }

        out[name] = {
            "ggml_vs_llama": agree("ggml", "llama"),
            "ggml_vs_numpy": agree("ggml", "numpy"),
            "llama_vs_numpy": agree("llama", "numpy"),
        }
        print(name, json.dumps(out[name]), flush=True)
    return out


def chats(path: Path, llama: str, work: Path) -> list[dict]:
    from shards.formats.tokenizer import Tokenizer

    tok, rows = Tokenizer.load(path), []
    eos = list(tok.eos_token_ids)
    for question in CHATS:
        prompt = tok.encode_chat([{"role": "user", "content": question}])
        ids = work / "chat.json"
        ids.write_text(json.dumps(prompt))
        answers = {"llama.cpp": theirs(llama, "greedy", path, "--tokens", ids, "--n", 40, "--eos", *eos)["tokens"]}
        for name in ("ggml", "numpy"):
            answers[name] = ours("greedy", path, ids, 40, name, *eos)["tokens"]
        rows.append(
            {"question": question, **{k: tok.decode([t for t in v if t not in eos]) for k, v in answers.items()}}
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def pipeline(models: dict[str, Path], tokens: int = 128) -> list[dict]:
    """One greedy stream through the HTTP API: 1 node vs 3 nodes on loopback (ggml, 1 thread each: three nodes
    share this machine's cores), for SmolLM2 (30 layers) and the random 357.6M Q8_0 model (8 layers)."""
    from bench.bench_cluster import decode_rate, stream_stamps
    from bench.local_cluster import Cluster

    rows = []
    for name, splits in (("smollm2-q4_1", ["0:10", "10:20", "20:30"]), ("random357m-q8_0", ["0:3", "3:6", "6:8"])):
        path = models[name]
        model_id = "smollm2-135m-instruct" if name.startswith("smollm2") else path.stem.lower()
        for shards in (None, splits):
            n = 1 if shards is None else 3
            with Cluster(
                path, n, shards=shards, api_nodes=1, model_id=model_id, engine="ggml", extra=["--threads", "1"]
            ) as c:
                url = c.nodes[0].api_url
                stream_stamps(url, model_id, "warm up", 4)
                rates = [
                    decode_rate(stream_stamps(url, model_id, f"Tell me a long story {i}.", tokens)) for i in range(3)
                ]
            rows.append({"model": name, "nodes": n, "tok_s": statistics.median(rates), "rounds": rates, "load": load()})
            print(json.dumps(rows[-1]), flush=True)
    return rows


GOALS = {"decode1": {"smollm2-q4_1": 0.6, "random357m-q8_0": 0.9, "random357m-q4_0": 0.9}, "prefill256": 0.8}


def report(results: dict) -> str:
    """Markdown: per model and thread count, best-of-rounds figures, the ratio of bests and the median of the
    per-round ratios (each round ran ours and llama.cpp back to back), against GOALS."""
    lines = [
        "| model | threads | metric | ours (best) | llama.cpp (best) | ratio of bests | median round ratio | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = results.get("speed", [])
    for model in dict.fromkeys(r["model"] for r in rows):
        for t in sorted({r["threads"] for r in rows}):
            mine = [r for r in rows if r["model"] == model and r["threads"] == t]
            for ref in ("llama", "llama_plain"):
                if ref not in mine[0]:
                    continue
                label = "llama.cpp" if ref == "llama" else "llama.cpp, no repack"
                for metric in ("decode1", "decode8", "decode16", "prefill256"):
                    if any(metric not in r["ours"] or metric not in r[ref] for r in mine):
                        continue  # a result file from before the metric existed
                    ours_best = max(r["ours"][metric] for r in mine)
                    ref_best = max(r[ref][metric] for r in mine)
                    ratio = statistics.median(r["ours"][metric] / r[ref][metric] for r in mine)
                    goal = GOALS.get(metric)
                    goal = goal.get(model) if isinstance(goal, dict) else goal
                    if metric == "decode8":
                        goal_text = f"8 streams >= 4x one: {ours_best / max(r['ours']['decode1'] for r in mine):.2f}x"
                    elif metric == "decode16":
                        goal_text = f"16 streams: {ours_best / max(r['ours']['decode1'] for r in mine):.2f}x one"
                    else:
                        goal_text = f">= {goal}x" if goal and ref == "llama" else ""
                    lines.append(
                        f"| {model} | {t} | {metric} ({label}) | {ours_best:.1f} | {ref_best:.1f} | "
                        f"{ours_best / ref_best:.2f} | {ratio:.2f} | {goal_text} |"
                    )
    loads = [r["load"] for r in rows]
    if loads:
        lines.append(f"\nLoad average during the rounds: {min(loads):.1f}-{max(loads):.1f} (2 cores).")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--report":
        print(report(json.loads(Path(sys.argv[2]).read_text())))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--ours":  # a measurement in this fresh process
        what, path, *rest = sys.argv[2:]
        path = Path(path)
        if what == "speed":
            result = ours_speed(path, int(rest[0]))
        elif what == "memory":
            result = ours_memory(path, int(rest[0]), int(rest[1]))
        elif what == "top":
            result = ours_top(path, json.loads(Path(rest[0]).read_text()), rest[1], rest[2])
        else:
            result = ours_greedy(
                path, json.loads(Path(rest[0]).read_text()), int(rest[1]), rest[2], [int(t) for t in rest[3:]]
            )
        print(json.dumps(result))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--only", default="speed,agreement,chats,memory,pipeline")
    ap.add_argument("--models", help="comma-separated subset of " + ", ".join(MODEL_NAMES) + " (default: all)")
    ap.add_argument("--out", type=Path, default=Path("bench-ggml.json"))
    args = ap.parse_args()
    models, only = model_paths(), set(args.only.split(","))
    if args.models:
        unknown = set(args.models.split(",")) - set(models)
        if unknown:
            ap.error(f"unknown models {sorted(unknown)}: choose from {', '.join(models)}")
        models = {name: path for name, path in models.items() if name in args.models.split(",")}
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "speed" in only:
            results["speed"] = speed_rounds(
                models, [int(t) for t in args.threads.split(",")], args.rounds, args.llama_python
            )
        if "agreement" in only:
            results["agreement"] = agreement(models, args.llama_python, work)
        if "chats" in only:
            results["chats"] = chats(models["smollm2-q4_1"], args.llama_python, work)
        if "memory" in only:
            results["memory"] = memory(models)
        if "pipeline" in only:
            results["pipeline"] = pipeline(models)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
