"""Train exo-node's bundled demo model, `exo-demo`: a ~3M-parameter Llama on the King James Bible, in numpy.

Rerun (from the repository root, Debian/Ubuntu; about 40 minutes on 2 CPU cores):

    apt-get install -y bible-kjv-text bible-kjv     # the text (bible-kjv-text) and its reader `bible` (bible-kjv)
    OPENBLAS_NUM_THREADS=1 .venv/bin/python -m shards.demo.train --minutes 38 --out shards/demo/exo-demo

(One BLAS thread keeps step times steady on a machine shared with other work; with two threads contending for two
busy cores, OpenBLAS steps were many times slower. On an idle machine more threads are faster.)

`--steps N` instead of `--minutes` fixes the step count (and the learning-rate schedule) instead of the wall-clock
budget; `--seed` seeds initialisation and batch sampling. Only the project's own dependencies are used (numpy,
tokenizers, safetensors, ml_dtypes); the forward and backward passes are written out in `llama_train.py`.

Corpus: the King James Version (1611), public domain (its copyright has expired; see
/usr/share/doc/bible-kjv-text/copyright), as packaged by Debian's `bible-kjv-text`. Verse references are dropped;
each chapter becomes one paragraph of prose, chapters are separated by a blank line. Every 50th chapter (~2% of the
text) is held out for the validation loss. The tokenizer is a byte-level BPE with 2048 tokens trained on the
training chapters; every training window is `<|begin_of_text|>` followed by 127 tokens taken from a random offset
of the training text (the targets: those 127 and the next), exactly how a prompt reaches the model through the API.

The output folder is a Hugging Face Llama folder the project's engine loads like any other: config.json,
model.safetensors (bfloat16, tied embeddings), tokenizer.json, tokenizer_config.json, generation_config.json,
plus training.json (provenance and results) and words.txt (every distinct lowercase word of the corpus).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from shards.demo import llama_train as lt

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# The model continues text: a conversation is rendered as its messages' plain text, one per line, after the bos.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
)
CORPUS = {
    "name": "King James Version of the Bible (1611)",
    "source": "Debian package bible-kjv-text (read with `bible -f Gen1:1-Rev22:21` from bible-kjv)",
    "license": "Public domain: the copyright of the King James Version text has expired "
    "(/usr/share/doc/bible-kjv-text/copyright). The packaged retrieval data carries Chip Chapin's notice "
    "'provided for unrestricted use ... Users may copy, modify or distribute this file at will'.",
}
VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
HOLDOUT_EVERY = 50
DEMO_SHAPE = lt.LlamaShape(
    vocab_size=2048,
    hidden_size=192,
    n_layers=6,
    n_heads=6,
    intermediate_size=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
)


# -- corpus and tokenizer -----------------------------------------------------------------------------------------
def load_chapters() -> list[str]:
    """The whole KJV as one prose string per chapter (verse references stripped, verses joined by spaces)."""
    if shutil.which("bible") is None:
        sys.exit("the `bible` reader is missing: apt-get install -y bible-kjv-text bible-kjv")
    dump = subprocess.run(
        ["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True, cwd="/tmp"
    ).stdout
    chapters: dict[tuple[str, str], list[str]] = {}
    for line in dump.splitlines():
        if not line.strip():
            continue
        m = VERSE.match(line)
        if m is None:
            sys.exit(f"unexpected line in the bible dump: {line!r}")
        chapters.setdefault((m[1], m[2]), []).append(" ".join(m[4].split()))
    n_verses = sum(len(v) for v in chapters.values())
    if n_verses != 31102:  # the KJV's verse count: anything else means the dump is not the whole text
        sys.exit(f"expected 31102 verses, got {n_verses}")
    return [" ".join(verses) for verses in chapters.values()]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # encode(text) with special tokens gives <|begin_of_text|> + text, like Llama tokenizers
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def token_stream(tok: Tokenizer, chapters: list[str]) -> np.ndarray:
    sep = tok.encode("\n\n", add_special_tokens=False).ids
    ids: list[int] = []
    for enc in tok.encode_batch(chapters, add_special_tokens=False):
        ids += enc.ids + sep
    return np.asarray(ids, dtype=np.int32)


def windows(stream: np.ndarray, offsets: np.ndarray, seq: int, bos: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs [bos, s[o], ..., s[o+seq-2]] and targets [s[o], ..., s[o+seq-1]] for each offset o."""
    idx = offsets[:, None] + np.arange(seq)[None, :]
    targets = stream[idx]
    inputs = np.concatenate([np.full((len(offsets), 1), bos, dtype=stream.dtype), targets[:, :-1]], axis=1)
    return inputs, targets


def eval_loss(params, shape, val_inputs, val_targets, batch: int) -> float:
    total = 0.0
    for i in range(0, len(val_inputs), batch):
        x, y = val_inputs[i : i + batch], val_targets[i : i + batch]
        total += lt.loss(params, shape, x, y) * len(x)
    return total / len(val_inputs)


# -- output -------------------------------------------------------------------------------------------------------
def write_folder(out: Path, params, shape, tok: Tokenizer, chapters: list[str], info: dict) -> None:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    lt.export_hf(params, shape, out, bos_id=bos, eos_id=eos, dtype="bfloat16")
    tok.save(str(out / "tokenizer.json"))
    special = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": shape.max_position_embeddings,
        "added_tokens_decoder": {str(bos): {"content": BOS, **special}, str(eos): {"content": EOS, **special}},
        "chat_template": CHAT_TEMPLATE,
    }
    gcfg = {"bos_token_id": bos, "eos_token_id": eos}
    for name, data in (("tokenizer_config.json", tcfg), ("generation_config.json", gcfg), ("training.json", info)):
        (out / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    words = sorted(set(re.findall(r"[a-z]+", "\n".join(chapters).lower())))
    (out / "words.txt").write_text("\n".join(words) + "\n", encoding="utf-8")


def greedy_sample(out: Path, prompt: str, n: int = 64) -> str:
    """Continue `prompt` greedily with the project's own engine on the exported (bf16) folder."""
    from shards.engines.numpy_engine import NumpyEngine
    from shards.formats.config import ModelConfig
    from shards.formats.tokenizer import Tokenizer as ExoTokenizer
    from shards.model.shard import Shard
    from shards.reference.generate import generate

    cfg, etok = ModelConfig.from_dir(out), ExoTokenizer(out)
    engine = NumpyEngine(out, Shard.whole("exo-demo", cfg.n_layers), cfg)
    ids = [r.token for r in generate([engine], etok.encode(prompt), n, eos_ids=etok.eos_token_ids)]
    return etok.decode(ids)


# -- training -----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "exo-demo")
    ap.add_argument("--minutes", type=float, default=38.0, help="wall-clock budget of the training loop")
    ap.add_argument("--steps", type=int, default=0, help="train exactly this many steps instead (0: use --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per training sequence, bos included")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=200)
    args = ap.parse_args(argv)
    shape, started = DEMO_SHAPE, time.time()
    rng = np.random.default_rng(args.seed)

    chapters = load_chapters()
    train_ch = [c for i, c in enumerate(chapters) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    val_ch = [c for i, c in enumerate(chapters) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    tok = train_tokenizer(train_ch, shape.vocab_size)
    bos = tok.token_to_id(BOS)
    train, val = token_stream(tok, train_ch), token_stream(tok, val_ch)
    val_x, val_y = windows(val, np.arange(0, len(val) - args.seq, args.seq), args.seq, bos)
    print(
        f"corpus: {len(chapters)} chapters, {sum(map(len, chapters))} chars; tokens train {len(train)}, "
        f"validation {len(val)} ({len(val_x)} windows); tokenizer vocab {tok.get_vocab_size()}",
        flush=True,
    )

    params = lt.init_params(shape, rng)
    opt = lt.AdamW(params, weight_decay=args.weight_decay)
    print(f"model: {lt.n_params(params)} parameters, {shape}", flush=True)
    budget = args.minutes * 60.0
    t0, step, recent, history = time.time(), 0, [], []
    train_loss = val_loss = float("nan")
    try:
        while True:
            elapsed = time.time() - t0
            progress = step / args.steps if args.steps else elapsed / budget
            if progress >= 1.0:
                break
            lr = lt.lr_at(progress, step, args.lr, args.warmup)
            offsets = rng.integers(0, len(train) - args.seq, size=args.batch)
            x, y = windows(train, offsets, args.seq, bos)
            value, grads = lt.loss_and_grads(params, shape, x, y)
            norm = lt.clip_grads(grads, args.clip)
            opt.step(params, grads, lr)
            recent.append(value)
            step += 1
            if step % args.log_every == 0:
                train_loss = float(np.mean(recent))
                recent = []
                print(
                    f"step {step:5d}  {elapsed / 60:5.1f} min  lr {lr:.2e}  grad-norm {norm:6.3f}  "
                    f"train loss {train_loss:.4f}",
                    flush=True,
                )
            if step % args.eval_every == 0:
                val_loss = eval_loss(params, shape, val_x, val_y, args.batch)
                history.append(
                    {
                        "step": step,
                        "minutes": round(elapsed / 60, 2),
                        "train_loss": round(train_loss, 4),
                        "val_loss": round(val_loss, 4),
                    }
                )
                print(f"step {step:5d}  validation loss {val_loss:.4f}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: saving the model as it is", flush=True)
    train_secs = time.time() - t0
    if recent:
        train_loss = float(np.mean(recent))
    val_loss = eval_loss(params, shape, val_x, val_y, args.batch)
    print(
        f"done: {step} steps in {train_secs / 60:.1f} min; train loss {train_loss:.4f}, validation loss {val_loss:.4f}",
        flush=True,
    )

    info = {
        "model": "exo-demo",
        "corpus": CORPUS
        | {
            "chapters": len(chapters),
            "characters": sum(map(len, chapters)),
            "held_out": f"every {HOLDOUT_EVERY}th chapter ({len(val_ch)} chapters)",
        },
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": tok.get_vocab_size(),
            "train_tokens": int(len(train)),
            "validation_tokens": int(len(val)),
        },
        "shape": {k: getattr(shape, k) for k in shape.__dataclass_fields__},
        "parameters": lt.n_params(params),
        "training": {
            "seed": args.seed,
            "steps": step,
            "batch": args.batch,
            "seq_len": args.seq,
            "tokens_seen": step * args.batch * args.seq,
            "peak_lr": args.lr,
            "warmup_steps": args.warmup,
            "schedule": "linear warmup, cosine decay to 10% of peak",
            "optimizer": "AdamW(0.9, 0.95)",
            "weight_decay": args.weight_decay,
            "grad_clip": args.clip,
            "dtype": "float32",
            "budget_minutes": None if args.steps else args.minutes,
            "train_minutes": round(train_secs / 60, 2),
            "wall_minutes": round((time.time() - started) / 60, 2),
        },
        "final_train_loss": round(train_loss, 4),
        "final_validation_loss": round(val_loss, 4),
        "history": history,
        "command": "python -m shards.demo.train " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    write_folder(args.out, params, shape, tok, chapters, info)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.1f} MB)", flush=True)
    for prompt in ("And God said, Let there be", "In the beginning"):
        print(f"greedy: {prompt!r} -> {greedy_sample(args.out, prompt)!r}", flush=True)


if __name__ == "__main__":
    main()
