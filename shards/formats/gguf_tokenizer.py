"""A `tokenizers.Tokenizer` built from a GGUF file's tokenizer metadata (no BPE is written here).

Two vocabulary kinds, as llama.cpp names them in `tokenizer.ggml.model`:

- `gpt2`: byte-level BPE with the file's merges. Text is first split by the regexes llama.cpp uses for the file's
  `tokenizer.ggml.pre` (the splits the merges were learned on), then mapped to the byte alphabet.
- `llama`: SentencePiece BPE with byte fallback. The file stores scores instead of merges; merges are recovered by
  ranking every split of every token by the token's score (the standard conversion, as transformers does it).

Tokens the file marks CONTROL become special tokens and USER_DEFINED ones plain added tokens: both are matched
whole in the input text, never split, as llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from shards.formats.gguf_file import FLOATS, INTS, STRINGS, GGUFError, GGUFFile, open_gguf

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's split for one `tokenizer.ggml.pre`: regexes applied in turn, each splitting the previous pieces."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is taken whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token key


_PRE = {
    "gpt2": PreTokenizer((_GPT2,)),
    "digits": PreTokenizer((r"\p{N}", _GPT2)),
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizer((_QWEN2,)),
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
}
# tokenizer.ggml.pre -> split (the groups llama.cpp's llama-vocab.cpp gives the same regexes)
PRE_TOKENIZERS = {
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "mpt", "olmo", "jais", "trillion"], _PRE["gpt2"]),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"], _PRE["digits"]),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"], _PRE["llama3"]),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2"], _PRE["qwen2"]),
    "default": _PRE["default"],
}


@dataclass(frozen=True)
class GGUFTokenizer:
    """What shards.formats.tokenizer.Tokenizer needs from a GGUF file."""

    hf: Tokenizer
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    eos_token_ids: frozenset[int]


def gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    f = open_gguf(path)
    kind = f.get_str("tokenizer.ggml.model")
    tokens = f.get_list("tokenizer.ggml.tokens", STRINGS, "strings")
    if not tokens:
        raise GGUFError(f"{f.path}: tokenizer.ggml.tokens is empty")
    types = f.get_list("tokenizer.ggml.token_type", INTS, "integers", [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}

    def token_id(key: str) -> int | None:
        i = f.get_int(f"tokenizer.ggml.{key}", None)
        if i is not None and not 0 <= i < len(tokens):
            raise GGUFError(f"{f.path}: tokenizer.ggml.{key} {i} is outside the vocabulary of {len(tokens)} tokens")
        return i

    bos, eos, unk = token_id("bos_token_id"), token_id("eos_token_id"), token_id("unknown_token_id")
    stop = {i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
    if kind == "gpt2":
        pre = _pre_tokenizer(f)
        tok = _byte_level(f, vocab, pre)
        add_bos = f.get_bool("tokenizer.ggml.add_bos_token", pre.add_bos)
    elif kind == "llama":
        add_prefix = f.get_bool("tokenizer.ggml.add_space_prefix", True)
        tok = _sentencepiece(f, tokens, vocab, None if unk is None else tokens[unk], add_prefix)
        add_bos = f.get_bool("tokenizer.ggml.add_bos_token", True)
    else:
        raise GGUFError(f"{f.path}: unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
    add_eos = f.get_bool("tokenizer.ggml.add_eos_token", False)
    for flag, tid, what in ((add_bos, bos, "add_bos_token"), (add_eos, eos, "add_eos_token")):
        if flag and tid is None:
            raise GGUFError(f"{f.path}: tokenizer.ggml.{what} is set but the file names no such token")
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    )
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFError(
            f"{f.path}: special tokens do not match the vocabulary (tokenizer has "
            f"{tok.get_vocab_size(with_added_tokens=True)} ids for {len(tokens)} tokens)"
        )
    single = ([f"{tokens[bos]}:0"] if add_bos else []) + ["$A:0"] + ([f"{tokens[eos]}:0"] if add_eos else [])
    specials = [(tokens[i], i) for i, flag in ((bos, add_bos), (eos, add_eos)) if flag]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return GGUFTokenizer(
        hf=tok,
        bos_token=None if bos is None else tokens[bos],
        eos_token=None if eos is None else tokens[eos],
        chat_template=f.get_str("tokenizer.chat_template", None),
        eos_token_ids=frozenset(stop),
    )


def _pre_tokenizer(f: GGUFFile) -> PreTokenizer:
    name = f.get_str("tokenizer.ggml.pre", "default")  # llama.cpp's own fallback for files without the key
    if name not in PRE_TOKENIZERS:
        raise GGUFError(
            f"{f.path}: unsupported pre-tokenizer {name!r} (tokenizer.ggml.pre); supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[name]


def _merges(f: GGUFFile, vocab: dict[str, int]) -> list[tuple[str, str]]:
    raw = f.get_list("tokenizer.ggml.merges", STRINGS, "strings", None)
    if not raw:
        raise GGUFError(
            f"{f.path}: a gpt2 (byte-level BPE) vocabulary needs merges, but tokenizer.ggml.merges is missing or empty"
        )
    merges = []
    for n, m in enumerate(raw):
        parts = m.split(" ")
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab or parts[0] + parts[1] not in vocab:
            raise GGUFError(f"{f.path}: merge #{n} {m!r} is not two vocabulary tokens whose join is a token")
        merges.append((parts[0], parts[1]))
    return merges


def _byte_level(f: GGUFFile, vocab: dict[str, int], pre: PreTokenizer) -> Tokenizer:
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(f, vocab), ignore_merges=pre.ignore_merges))
    except GGUFError:
        raise
    except Exception as e:  # tokenizers raises bare Exceptions for inconsistent vocabularies
        raise GGUFError(f"{f.path}: cannot build the BPE tokenizer ({e})") from None
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(
    f: GGUFFile, tokens: list[str], vocab: dict[str, int], unk: str | None, add_prefix: bool
) -> Tokenizer:
    scores = f.get_list("tokenizer.ggml.scores", FLOATS, "floats")
    if len(scores) != len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    raw = f.get_list("tokenizer.ggml.merges", STRINGS, "strings", None)
    merges = _merges(f, vocab) if raw else _merges_from_scores(vocab, dict(zip(tokens, scores)))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    except Exception as e:
        raise GGUFError(f"{f.path}: cannot build the SentencePiece tokenizer ({e})") from None
    scheme = "first" if add_prefix else "never"  # llama.cpp's add_space_prefix: one space before the text
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the pair whose joined piece scores highest: every split of every token into two
    tokens is a merge, ranked by the joined token's score (ties broken as transformers' generate_merges does)."""
    found = []
    for token, score in scores.items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(score, len(a), len(b), a, b) for a, b in pairs]
    found.sort(key=lambda m: m[:3], reverse=True)  # stable: equal keys keep the per-token id order
    return [(a, b) for *_, a, b in found]
