"""The stall trial: a greedy stream on a keyed 3-node cluster while 16 bad 1 MB bodies hit the entry.

    uv run python -m bench.bench_stall [--trials 10] [--model smollm2] [--tokens 160] [--bodies 16]

As root (Linux). Three hosts of tests/support/netns.py (one network namespace each, on a private bridge), each an
exo node on the default engine with a cluster key and UDP discovery, nothing else configured; host 0's API is the
entry. Per trial, a probe inside host 0 (this module with `--probe`) streams a greedy chat completion and, once
`--after` chunks have arrived, sends `--bodies` request bodies of ~1 MB at once that parse as JSON but are not a
valid request (every `stop` entry a number), so each costs the entry a full parse before its 400.

Reported per trial: the stream's longest gap between chunks, the time until every bad body was answered (and that
all were 4xx), whether hosts 1 and 2 counted the entry as gone (a `peer host0 left` line in their logs during the
trial) and how many of their health checks of it timed out but were tolerated (near misses), the entry's replays (its `replays` status counter) and whether the text is the first trial's (greedy: it
must be). A trial passes when its longest gap is under the membership's detection time (misses x (interval +
check timeout): 2 x (1 + 1) s by default, node/runtime/membership.py) and every body was refused with a 4xx; the
run exits 1 unless all do. On a shared machine the figures are under load: say so beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.local_cluster import READY_API, ROOT

API = "http://127.0.0.1:52415"
DETECTION_S = 2 * (1.0 + 1.0)  # Membership's defaults: misses x (interval + check_timeout)
PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."


# --- the probe: runs inside host 0 ---------------------------------------------------------------------------


def bad_body(model: str, size: int) -> bytes:
    """~`size` bytes of valid JSON that is not a valid request: parsed whole before it can be refused."""
    stops = ",".join(["0"] * (size // 2))
    return f'{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"stop":[{stops}]}}'.encode()


async def probe(model: str, tokens: int, bodies: int, size: int, after: int) -> dict:
    import aiohttp

    body = bad_body(model, size)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def replays() -> int:
            async with http.get(f"{API}/v1/topology") as r:
                return int((await r.json())["nodes"][0]["status"].get("replays", 0))

        async def refuse() -> tuple[int, float]:
            started = time.monotonic()
            async with http.post(
                f"{API}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
                return r.status, time.monotonic() - started

        before = await replays()
        times, text, burst = [], [], None
        request = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
        }
        async with http.post(f"{API}/v1/chat/completions", json=request) as r:
            if r.status != 200:
                raise RuntimeError(f"the stream was refused: {r.status} {await r.text()}")
            async for line in r.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
                if not delta:
                    continue
                times.append(time.monotonic())
                text.append(delta)
                if len(times) == after:
                    burst = asyncio.gather(*(refuse() for _ in range(bodies)))
                    burst_started = time.monotonic()
        refused = await burst if burst is not None else []
        gaps = [b - a for a, b in zip(times, times[1:])]
        return {
            "chunks": len(times),
            "longest_gap_s": max(gaps, default=0.0),
            "refusal_s": max((t for _, t in refused), default=0.0),
            "statuses": sorted({s for s, _ in refused}),
            "burst_at_s": burst_started - times[0] if burst is not None else None,
            "replays": await replays() - before,
            "text": "".join(text),
        }


# --- the cluster: runs as root outside -----------------------------------------------------------------------


def start_host(lan, i: int, key: Path, model: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "node.cli", "--model", model, "--node-id", f"host{i}"]
    cmd += ["--cluster-key-file", str(key), "--speed", "1"]  # the hosts share this machine's cores: equal
    return subprocess.Popen(lan.exec(i, *cmd), cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def wait_ready(lan, procs, logs: list[Path], timeout: float = 600) -> None:
    from bench.multihost_lan import ns_get

    deadline = time.monotonic() + timeout
    for p, log in zip(procs, logs):
        while not READY_API.search(log.read_text()):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"a node did not start: see {log}")
            time.sleep(0.5)

    def plans():
        return [((ns_get(lan, i, f"{API}/v1/topology") or {}).get("plan") or []) for i in range(len(procs))]

    while not (len((p := plans())[0]) == len(procs) and all(x == p[0] for x in p)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the hosts never agreed on a {len(procs)}-node plan: see {logs[0].parent}")
        time.sleep(0.5)


def trial(lan, args, logs: list[Path]) -> dict:
    marks = [log.stat().st_size for log in logs]
    cmd = [sys.executable, "-m", "bench.bench_stall", "--probe", "--model", args.model_id]
    cmd += ["--tokens", str(args.tokens), "--bodies", str(args.bodies), "--size", str(args.size)]
    cmd += ["--after", str(args.after)]
    done = subprocess.run(lan.exec(0, *cmd), cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the probe failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    during = [logs[i].read_bytes()[marks[i] :].decode(errors="replace") for i in range(len(logs))]
    result["entry_left"] = [f"host{i}" for i in (1, 2) if "peer host0 left" in during[i]]
    # near misses: health checks of the entry that timed out but were tolerated (Membership.misses)
    missed = f"peer at {lan.ips[0]}:"
    result["entry_missed"] = sum(
        missed in line and "did not answer" in line for i in (1, 2) for line in during[i].splitlines()
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--model", default="smollm2", help="a model path or packaged model (default: smollm2)")
    ap.add_argument("--tokens", type=int, default=160, help="max_tokens of the greedy stream")
    ap.add_argument("--bodies", type=int, default=16, help="bad bodies sent at once")
    ap.add_argument("--size", type=int, default=1_000_000, help="bytes per bad body (the API's limit is 1 MiB)")
    ap.add_argument("--after", type=int, default=8, help="stream chunks before the burst")
    ap.add_argument("--settle", type=float, default=6.0, help="seconds between trials")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(asyncio.run(probe(args.model, args.tokens, args.bodies, args.size, args.after))))
        return

    from node.security import write_key_file
    from shards.formats.packaged import resolve_model
    from tests.support import netns  # the multihost tests' hosts: as bench_multihost.py

    if why := netns.available():
        sys.exit(why)
    path, args.model_id = resolve_model(args.model)
    folder = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    key, logs = folder / "cluster.key", [folder / f"host{i}.log" for i in range(3)]
    write_key_file(key)
    print(f"logs: {folder}", flush=True)
    results = []
    with netns.PrivateLan(3, subnet=86) as lan, contextlib.ExitStack() as stack:  # nodes stop first
        procs = [start_host(lan, i, key, str(path), logs[i]) for i in range(3)]
        for p in procs:
            stack.callback(lambda p=p: (p.kill(), p.wait()))
        wait_ready(lan, procs, logs)
        for n in range(args.trials):
            r = trial(lan, args, logs)
            r["same_text"] = r["text"] == results[0]["text"] if results else True
            r["ok"] = (
                r["longest_gap_s"] < DETECTION_S and bool(r["statuses"]) and all(400 <= s < 500 for s in r["statuses"])
            )
            results.append(r)
            print(
                f"trial {n + 1}: longest gap {r['longest_gap_s']:.2f} s over {r['chunks']} chunks, {args.bodies} bad "
                f"bodies refused in {r['refusal_s']:.2f} s ({r['statuses']}), entry counted gone by "
                f"{r['entry_left'] or 'no one'} ({r['entry_missed']} checks of it missed), replays {r['replays']}, same text {r['same_text']}"
                f"{'' if r['ok'] else '  FAIL'}",
                flush=True,
            )
            time.sleep(args.settle)
            wait_ready(lan, procs, logs, timeout=120)  # every host back in one plan before the next trial
    gaps = [r["longest_gap_s"] for r in results]
    passed = sum(r["ok"] for r in results)
    print(
        f"{passed}/{len(results)} trials passed (gap < {DETECTION_S:g} s, every body a 4xx); longest gap median "
        f"{statistics.median(gaps):.2f} s, max {max(gaps):.2f} s; refusal median "
        f"{statistics.median(r['refusal_s'] for r in results):.2f} s; membership changed in "
        f"{sum(bool(r['entry_left']) for r in results)}; text differed in {sum(not r['same_text'] for r in results)}"
    )
    sys.exit(0 if passed == len(results) and all(r["same_text"] for r in results) else 1)


if __name__ == "__main__":
    main()
