"""`exo-node` command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shards.config import ModelConfig
from shards.generate import generate
from shards.numpy_engine import NumpyEngine
from shards.sampling import SamplingParams
from shards.shard import Shard
from shards.tokenizer import Tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="exo-node", description="Run a language model split across machines.")
    ap.add_argument("--model", type=Path, required=True, help="Hugging Face model folder")
    ap.add_argument("--prompt", required=True, help="generate a reply to this user message locally and exit")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int)
    args = ap.parse_args(argv)
    try:
        cfg = ModelConfig.from_dir(args.model)
        tok = Tokenizer(args.model)
        engine = NumpyEngine(args.model, Shard.whole(args.model.name, cfg.n_layers), cfg)
        params = SamplingParams(temperature=args.temperature, seed=args.seed)
    except ValueError as e:
        print(f"exo-node: {e}", file=sys.stderr)
        return 2
    prompt = tok.encode_chat([{"role": "user", "content": args.prompt}])
    stream = tok.stream()
    for result in generate([engine], prompt, args.max_tokens, params, tok.eos_token_ids):
        print(stream.push(result.token), end="", flush=True)
    print(stream.flush())
    return 0


if __name__ == "__main__":
    sys.exit(main())
