"""Train the demo model's small byte-level BPE vocabulary with `tokenizers` (issue 6).

Layout like the fixtures' (fixtures/README.md, "Vocabulary"): ids 0..n-1 byte-level BPE (byte alphabet +
merges), then the Qwen3.5 added tokens (three CONTROL, six USER_DEFINED), then `[PAD<id>]` rows up to the
embedding size. Pre-tokenizer: the `qwen35` split regex + byte-level; NFC normalizer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from recipes.demo_model import corpus

# llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35 / Qwen3.5 tokenizer.json (fixtures/README.md, step 3).
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                       "<think>", "</think>"]
ADDED_TOKENS = CONTROL_TOKENS + USER_DEFINED_TOKENS
N_BPE = 2000          # byte alphabet + merges
N_ROWS = 2048         # embedding rows (vocabulary padded like Qwen's)
N_TEXTS = 12000       # training conversations used to learn the merges

# GGUF token types (gguf.TokenType)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

_ADDED_RE = re.compile("|".join(re.escape(t) for t in ADDED_TOKENS))


def _plain_pieces(texts):
    """The text between added tokens: merges never span or include the special tokens."""
    for t in texts:
        for piece in _ADDED_RE.split(t):
            if piece:
                yield piece


def build_tokenizer(texts: list[str], n_bpe: int = N_BPE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_plain_pieces(texts), trainer)
    n = tok.get_vocab_size(with_added_tokens=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_DEFINED_TOKENS])
    for i, t in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(t) == n + i, (t, tok.token_to_id(t), n + i)
    return tok


def gguf_vocab(tok: Tokenizer, n_rows: int = N_ROWS) -> dict:
    """The tokenizer.ggml.* values: tokens, token_type, merges, special ids."""
    vocab = tok.get_vocab(with_added_tokens=True)
    n = len(vocab)
    if n > n_rows:
        raise ValueError(f"vocabulary of {n} tokens does not fit {n_rows} rows")
    tokens = [""] * n
    for text, i in vocab.items():
        tokens[i] = text
    n_bpe = n - len(ADDED_TOKENS)
    types = [NORMAL] * n_bpe + [CONTROL] * len(CONTROL_TOKENS) + [USER_DEFINED] * len(USER_DEFINED_TOKENS)
    tokens += [f"[PAD{i}]" for i in range(n, n_rows)]
    types += [UNUSED] * (n_rows - n)
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        "tokens": tokens, "token_type": types, "merges": merges,
        "eos_token_id": vocab["<|im_end|>"], "padding_token_id": vocab["<|endoftext|>"],
    }


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="Train the demo BPE vocabulary and save tokenizer.json.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n-texts", type=int, default=N_TEXTS)
    a = p.parse_args(argv)
    tok = build_tokenizer(corpus.corpus_texts("train", a.n_texts))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
