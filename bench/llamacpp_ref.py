"""REFERENCE HARNESS, not exo-node code: llama.cpp (llama-cpp-python) measured the way bench/bench_ggml.py measures
the ggml engine. It runs in a throwaway venv of its own, never in exo-node's environment:

    python3.11 -m venv /tmp/llamavenv && /tmp/llamavenv/bin/pip install llama-cpp-python numpy   # ~18 min build
    /tmp/llamavenv/bin/python bench/llamacpp_ref.py speed MODEL.gguf --threads 2
    /tmp/llamavenv/bin/python bench/llamacpp_ref.py logits MODEL.gguf --tokens ids.json --out top.npz [--all]
    /tmp/llamavenv/bin/python bench/llamacpp_ref.py greedy MODEL.gguf --tokens prompt.json --n 40
    /tmp/llamavenv/bin/python bench/llamacpp_ref.py prefill MODEL.gguf --lengths 1000,7000 --threads 2

Prints one JSON object. Flash attention on, unified KV for the 8-stream test, logits of the last row only in
prefill. `--no-extra-bufts` keeps the weights out of llama.cpp's repacked (CPU_REPACK/AMX) buffers, as exo-node does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import llama_cpp
import llama_cpp.llama_cpp as C
import numpy as np

N_SEQ = 16


def load(path: str, threads: int, extra_bufts: bool, n_ctx: int = 2048) -> llama_cpp.Llama:
    original_mp, original_cp = C.llama_model_default_params, C.llama_context_default_params

    def model_params():
        p = original_mp()
        p.use_extra_bufts = extra_bufts  # not a Llama() keyword in llama-cpp-python 0.3.36
        return p

    def context_params():
        p = original_cp()
        p.n_seq_max, p.kv_unified = N_SEQ, True
        return p

    C.llama_model_default_params, C.llama_context_default_params = model_params, context_params
    try:
        return llama_cpp.Llama(
            path,
            n_ctx=n_ctx,
            n_batch=1024,
            n_ubatch=1024,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=True,
            logits_all=False,
            verbose=False,
        )
    finally:
        C.llama_model_default_params, C.llama_context_default_params = original_mp, original_cp


class Runner:
    def __init__(self, llm):
        self.llm = llm  # owns the context: freed with it
        self.ctx, self.n_vocab = llm._ctx.ctx, llm.n_vocab()
        self.mem = C.llama_get_memory(self.ctx)
        self.batch = C.llama_batch_init(1024, 0, N_SEQ)

    def clear(self) -> None:
        C.llama_memory_clear(self.mem, True)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)"""
        b = self.batch
        b.n_tokens = len(rows)
        for j, (tok, pos, seq, want) in enumerate(rows):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, want
            b.seq_id[j][0] = seq
        if C.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))


def speed(args) -> dict:
    r = Runner(load(args.model, args.threads, not args.no_extra_bufts))
    rng = np.random.default_rng(0)
    hi = min(r.n_vocab, 20000)
    # decode, one stream: a 64-token context, then 64 steps; the median step
    r.clear()
    r.decode([(int(t), i, 0, i == 63) for i, t in enumerate(rng.integers(100, hi, 64))])
    tok, steps = int(r.logits(-1).argmax()), []
    for i in range(64):
        t0 = time.perf_counter()
        r.decode([(tok, 64 + i, 0, True)])
        tok = int(r.logits(-1).argmax())
        steps.append(time.perf_counter() - t0)
    out = {"decode1": 1 / statistics.median(steps)}
    for n in (8, 16):  # decode, n streams: each a 64-token context, then 32 steps of n rows
        r.clear()
        r.decode([(int(t), i, s, i == 63) for s in range(n) for i, t in enumerate(rng.integers(100, hi, 64))])
        toks, steps = [int(r.logits(64 * s + 63).argmax()) for s in range(n)], []
        for i in range(32):
            t0 = time.perf_counter()
            r.decode([(toks[s], 64 + i, s, True) for s in range(n)])
            toks = [int(r.logits(s).argmax()) for s in range(n)]
            steps.append(time.perf_counter() - t0)
        out[f"decode{n}"] = n / statistics.median(steps)
    # prefill: 256 tokens in one batch, logits of the last row; best of 3 after a warm-up
    times = []
    for k in range(4):
        r.clear()
        rows = [(int(t), i, 0, i == 255) for i, t in enumerate(np.random.default_rng(k).integers(100, hi, 256))]
        t0 = time.perf_counter()
        r.decode(rows)
        C.llama_synchronize(r.ctx)
        times.append(time.perf_counter() - t0)
    out["prefill256"] = 256 / min(times[1:])
    return out


def prefill(args) -> dict:
    """Seconds to the first token of prompts of each length (random ids; batches of 1024, logits of the last)."""
    lengths = [int(n) for n in args.lengths.split(",")]
    r = Runner(load(args.model, args.threads, not args.no_extra_bufts, n_ctx=max(lengths) + 16))
    rng = np.random.default_rng(0)
    r.decode([(int(t), i, 0, i == 63) for i, t in enumerate(rng.integers(100, 20000, 64))])  # warm-up
    seconds = {}
    for n in lengths:
        r.clear()
        ids = rng.integers(100, min(r.n_vocab, 20000), n)
        t0 = time.perf_counter()
        for a in range(0, n, 1024):
            r.decode([(int(ids[i]), i, 0, i == n - 1) for i in range(a, min(n, a + 1024))])
        C.llama_synchronize(r.ctx)
        seconds[n] = time.perf_counter() - t0
    return {"prefill_s": seconds}


def logits(args) -> dict:
    """Teacher-forced over the token ids, in one batch: each position's top 5 ids and logits."""
    ids = json.loads(open(args.tokens).read())
    r = Runner(load(args.model, args.threads, not args.no_extra_bufts, n_ctx=max(2048, len(ids))))
    chunk = args.chunk or len(ids)  # --chunk: batches of at most this many rows (ggml's flash attention kernel
    rows = []  # changes at 64 rows, and with it the summation order)
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        r.decode([(t, start + i, 0, True) for i, t in enumerate(part)])
        rows += [r.logits(i).copy() for i in range(len(part))]  # a view of llama.cpp's buffer otherwise
    rows = np.stack(rows)
    top = np.argsort(-rows, axis=-1)[:, :5]
    full = {"logits": rows.astype(np.float32)} if args.all else {}  # --all: every logit (small vocabularies)
    np.savez_compressed(args.out, ids=top, values=np.take_along_axis(rows, top, axis=-1), **full)
    return {"positions": len(ids), "out": args.out}


def greedy(args) -> dict:
    ids = json.loads(open(args.tokens).read())
    r = Runner(load(args.model, args.threads, not args.no_extra_bufts))
    r.decode([(t, i, 0, i == len(ids) - 1) for i, t in enumerate(ids)])
    out = []
    for i in range(args.n):
        out.append(int(r.logits(-1).argmax()))
        if out[-1] in args.eos:
            break
        r.decode([(out[-1], len(ids) + i, 0, True)])
    return {"tokens": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["speed", "logits", "greedy", "prefill"])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-extra-bufts", action="store_true")
    ap.add_argument("--tokens")
    ap.add_argument("--out")
    ap.add_argument("--all", action="store_true", help="logits: also save every logit of every position")
    ap.add_argument("--chunk", type=int, default=0, help="logits: decode in batches of at most this many tokens")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--eos", type=int, nargs="*", default=[])
    ap.add_argument("--lengths", default="1000,2000,4000,7000")
    args = ap.parse_args()
    result = {"speed": speed, "logits": logits, "greedy": greedy, "prefill": prefill}[args.what](args)
    print(json.dumps({"llama_cpp": llama_cpp.__version__, **result}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
