"""The ggml bench's memory mode (`bench.bench_ggml --only memory`): what a loaded shard costs in resident memory,
against its tensors' bytes in the file. Measured only in fresh processes (`bench.bench_ggml --ours memory MODEL
START END`, and whole exo-node processes), since a process that already loaded anything keeps some of it resident.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.ggml_harness import engine, ours
from shards.engines.base import StepInput
from shards.formats.loader import load_config

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """A process's resident memory fields from /proc (bytes)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) * 1024 for k in FIELDS}


def ours_memory(path: Path, start: int, end: int | None) -> dict:
    """Resident memory before and after loading the shard, against its tensors' bytes in the file."""
    import shards.engines.ggml.engine  # noqa: F401  (the library's own memory is not the shard's)
    from shards.formats.gguf_file import open_gguf
    from shards.formats.gguf_model import _hf_shapes

    load_config(path)  # nor is the file's parsed metadata (cached): the vocabulary alone is ~30 MB of objects
    before = proc_status()
    e = engine(path, 1, start, end)
    x = {"tokens": np.arange(8)} if e.shard.is_first else {"hidden": np.zeros((8, e.config.hidden_size), np.float32)}
    e.forward([StepInput("r", max_positions=64, **x)])
    after = proc_status()
    f = open_gguf(path)
    file_bytes = sum(f.tensor(n).nbytes for n in {name for name, _, _ in _hf_shapes(e.config, e.shard)})
    return {
        "layers": e.shard.layer_count,
        "file_bytes": file_bytes,
        "nbytes": e.nbytes(),
        **{f"{k}_delta": after[k] - before[k] for k in after},
        "rss": after["VmRSS"],
    }


def memory(models: dict[str, Path]) -> list[dict]:
    """The engine's load in a fresh process (resident memory before/after), and whole exo-node processes pinned to
    all layers or a third of them (ggml, and numpy for comparison)."""
    from bench.local_cluster import Cluster

    rows = []
    for name, path in models.items():
        n = load_config(path).n_layers
        for start, end in ((0, n), (0, n // 3), (n - n // 3, n)):
            rows.append({"model": name, "shard": f"{start}:{end}", **ours("memory", path, start, end)})
            print(json.dumps(rows[-1]), flush=True)
            for engine_name in ("ggml", "numpy"):
                with Cluster(
                    path,
                    1,
                    shards=[f"{start}:{end}"],
                    api_nodes=0,
                    engine=engine_name,
                    static_peers=False,
                    extra=["--threads", "1"] if engine_name == "ggml" else [],
                ) as c:
                    rows[-1][f"node_{engine_name}"] = proc_status(c.nodes[0].proc.pid)
            print(json.dumps(rows[-1]), flush=True)
    return rows
