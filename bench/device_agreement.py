"""The ggml engine on a GPU backend's device against the same engine on the CPU, in the terms llama.cpp's
`llama-perplexity --kl-divergence` reports for its own backends: mean KL divergence of the device's next-token
distribution from the CPU's, and the share of positions where both pick the same top token, over chunks of a text
scored on their second halves, each chunk starting with BOS where the model's tokenizer adds one (as
llama-perplexity does both).

    GGML_VK_VISIBLE_DEVICES=0 python -m bench.device_agreement --text README.md --device vulkan --quantize f16

Run llama-perplexity the same way (`-c CTX --chunks N`, base logits from its CPU backend with `-ngl 0 -dev none
--kl-divergence-base F`, then `-ngl 99 -dev Vulkan0 --kl-divergence-base F --kl-divergence`) on the same file and
text: the two programs' device-vs-CPU figures say whether a difference is the device's or exo-node's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from shards.engines.base import StepInput
from shards.engines.ggml.devices import load_backends
from shards.engines.ggml.engine import GgmlEngine
from shards.formats.loader import load_config
from shards.formats.packaged import DEFAULT_MODEL, resolve_model
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def chunk_logits(path: Path, device: str | None, quantize: str, chunks: list[np.ndarray], threads: int) -> np.ndarray:
    cfg = load_config(path)
    e = GgmlEngine(
        path,
        Shard.whole("m", cfg.n_layers),
        cfg,
        threads=threads,
        quantize=quantize,
        device=device,
        adapt_threads=False,
    )
    out = []
    for i, ids in enumerate(chunks):
        logits = e.forward([StepInput(f"c{i}", tokens=ids, max_positions=len(ids))], all_logits=True)[0]
        out.append(logits[len(ids) // 2 : -1])  # the positions llama-perplexity scores
        e.release(f"c{i}")
    e.close()
    return np.concatenate(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model folder or GGUF file (default: the packaged SmolLM2)")
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--device", default="vulkan")
    ap.add_argument("--quantize", default="f16", help="the engine's --quantize (none: the file's own types)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else resolve_model(DEFAULT_MODEL)[0]
    tok = Tokenizer.load(path)
    ids = np.array(tok.encode(args.text.read_text()))  # with BOS where the model has one, as llama.cpp tokenizes
    if len(ids) < args.ctx * args.chunks:
        raise SystemExit(f"{args.text}: {len(ids)} tokens, fewer than --ctx x --chunks = {args.ctx * args.chunks}")
    chunks = [ids[i * args.ctx : (i + 1) * args.ctx].copy() for i in range(args.chunks)]
    marked, plain = tok.encode("a"), tok.encode("a", add_special_tokens=False)
    if len(marked) > len(plain):  # the model's tokenizer starts a text with BOS: each chunk's first token is one
        for c in chunks:
            c[0] = marked[0]
    load_backends()
    cpu = log_softmax(chunk_logits(path, None, args.quantize, chunks, args.threads))
    dev = log_softmax(chunk_logits(path, args.device, args.quantize, chunks, args.threads))
    targets = np.concatenate([c[len(c) // 2 + 1 :] for c in chunks])  # the token each scored position predicts
    ppl = [float(np.exp(-lp[np.arange(len(targets)), targets].mean())) for lp in (cpu, dev)]
    kld = (np.exp(cpu) * (cpu - dev)).sum(axis=-1)
    same = np.mean(cpu.argmax(-1) == dev.argmax(-1))
    rms = np.sqrt(np.mean((np.exp(dev) - np.exp(cpu)) ** 2, axis=-1).mean())
    print(f"{path.name}, --quantize {args.quantize}, {len(cpu)} positions ({args.chunks} chunks of {args.ctx})")
    print(f"{args.device} vs CPU: mean KLD {kld.mean():.6f} (max {kld.max():.6f}), same top token {100 * same:.2f}%")
    print(f"(RMS of the probability differences over the vocabulary {rms:.2e})")
    print(f"perplexity: CPU {ppl[0]:.4f}, {args.device} {ppl[1]:.4f} (llama-perplexity's figure for the same chunks)")


if __name__ == "__main__":
    main()
