"""The Qwen3.5/3.6 tokenizer, built from GGUF metadata on the `tokenizers` library (no hand-written BPE).

Semantics follow llama.cpp and the official tokenizer.json (fixtures/README.md, "Pre-tokenization and BPE
semantics"): added tokens first, NFC, the `qwen35` split regex, byte-level merges-only BPE. This module never
renders templates and never prints; the chat path (template.py) decides which text may become added tokens.
"""

from __future__ import annotations

import logging
import re
import time
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from engine.errors import InputError, ModelFileError

log = logging.getLogger(__name__)

# llama.cpp token types (gguf-py TokenType / llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# llama-vocab.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35 (= tokenizer.json's Split regex). Qwen2's regex lacks \p{M}.
QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEX_BY_PRE = {"qwen35": QWEN35_SPLIT_REGEX, "qwen2": QWEN2_SPLIT_REGEX}

# Token texts llama.cpp treats as end of turn / end of generation when it loads a vocab (llama-vocab.cpp);
# for this vocabulary it derives EOT = <|im_end|> and EOG = {endoftext, im_end, fim_pad, repo_name, file_sep}.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
              "<｜end▁of▁sentence｜>")
_EOG_EXTRA_TEXTS = ("<|eom_id|>", "<|return|>", "<|call|>", "<|end_of_text|>")
_FIM_EOG_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|repo_name|>", "<fim-repo>", "<reponame>",
                  "<|file_sep|>", "<fim-sep>", "<file_sep>")

_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """Text as UTF-8 can carry it: a surrogate pair written as two code points is joined, and a lone
    surrogate (which no UTF-8 byte sequence can express) becomes U+FFFD. Everywhere text enters the
    engine the same rule applies, so `encode("a\\ud800b") == encode("a\\ufffdb")`."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
# str.translate table: byte-level char -> the latin-1 char of its byte, so .encode("latin-1") gives the bytes
_BYTE_LEVEL_TO_LATIN1 = {ord(c): chr(b) for c, b in _BYTE_DECODER.items()}


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: int | None
    eot: int | None
    pad: int | None
    add_bos: bool
    add_eos: bool
    eog: frozenset[int]


class Tokenizer:
    """Encode/decode for a byte-level BPE GGUF vocabulary (tokenizer.ggml.model = gpt2).

    `encode(text)` is llama.cpp's parse_special=false: CONTROL tokens stay literal text, USER_DEFINED ones
    (<think>, <tool_call> ...) are matched. `encode(text, special=True)` matches CONTROL tokens too.
    `encode_literal(text)` matches no added token at all (message content on the chat path, row B4).
    """

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
                 special: SpecialIds, pre: str, source: str = "<metadata>"):
        self.source = source
        self.pre = pre
        self.n_vocab = len(tokens)  # model vocab incl. UNUSED padding slots (the logits width)
        self.special = special
        self._tokens = tokens
        self._types = token_types
        self.added_tokens: dict[str, int] = {}
        self.control_ids: frozenset[int]
        control, user = [], []
        for i, ty in enumerate(token_types):
            if ty == TOKEN_CONTROL:
                control.append(i)
            elif ty == TOKEN_USER_DEFINED:
                user.append(i)
        for i in control + user:
            self.added_tokens.setdefault(tokens[i], i)
        self.control_ids = frozenset(control)
        self.user_defined_ids = frozenset(user)
        self._control_texts = frozenset(tokens[i] for i in control)
        # Leftmost-longest matching of added-token text, as tokenizers' AddedVocabulary does.
        self.added_token_regex = _alternation(self.added_tokens)
        self.control_token_regex = _alternation([tokens[i] for i in control])
        self._hf = _build_hf_tokenizer(tokens, token_types, merges, pre)
        self._hf.encode_special_tokens = True  # never changed afterwards: CONTROL text is literal in plain encode
        self._piece_bytes: list[bytes] | None = None

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gguf_or_path: Any) -> Tokenizer:
        """From an `engine.gguf.GGUFFile` or a path (a vocab-only GGUF without tensors is fine)."""
        if isinstance(gguf_or_path, str | Path):
            from engine.gguf import open_gguf

            gguf_or_path = open_gguf(gguf_or_path)
        return cls.from_metadata(gguf_or_path.metadata, source=str(getattr(gguf_or_path, "path", "<gguf>")))

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], source: str = "<metadata>") -> Tokenizer:
        t0 = time.perf_counter()
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelFileError(source, f"tokenizer.ggml.model: {model!r} is not supported (only byte-level BPE 'gpt2')")
        pre = md.get("tokenizer.ggml.pre", "qwen35")
        if pre not in SPLIT_REGEX_BY_PRE:
            raise ModelFileError(source, f"tokenizer.ggml.pre: {pre!r} is not supported (qwen35, qwen2)")
        tokens = md.get("tokenizer.ggml.tokens")
        types = md.get("tokenizer.ggml.token_type")
        merges = md.get("tokenizer.ggml.merges")
        for key, value in (("tokens", tokens), ("token_type", types), ("merges", merges)):
            if not isinstance(value, list) or not value:
                raise ModelFileError(source, f"tokenizer.ggml.{key}: missing or empty")
        if len(types) != len(tokens):
            raise ModelFileError(source, f"tokenizer.ggml.token_type: {len(types)} entries for {len(tokens)} tokens")
        n = len(tokens)

        def token_id(key: str) -> int | None:
            v = md.get(f"tokenizer.ggml.{key}")
            if v is None:
                return None
            if not isinstance(v, int) or not 0 <= v < n:
                raise ModelFileError(source, f"tokenizer.ggml.{key}: {v!r} is not a token id (vocab {n})")
            return v

        bos, eos, pad = token_id("bos_token_id"), token_id("eos_token_id"), token_id("padding_token_id")
        eot = token_id("eot_token_id")
        by_text = {}
        for i, ty in enumerate(types):
            if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
                by_text.setdefault(tokens[i], i)
        if eot is None:
            eot = next((by_text[t] for t in _EOT_TEXTS if t in by_text), None)
        eog = {i for i in (eos, eot) if i is not None}
        eog |= {by_text[t] for t in _EOT_TEXTS + _EOG_EXTRA_TEXTS + _FIM_EOG_TEXTS if t in by_text}
        special = SpecialIds(bos=bos, eos=eos, eot=eot, pad=pad,
                             add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)),
                             add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)),
                             eog=frozenset(eog))
        try:
            tok = cls(tokens, types, merges, special, pre, source)
        except Exception as exc:  # the tokenizers library rejects an inconsistent vocab/merge table
            raise ModelFileError(source, f"tokenizer: cannot build BPE from metadata ({exc})") from None
        log.info("tokenizer built from %s in %.3f s (%d tokens, %d merges)", source,
                 time.perf_counter() - t0, n, len(merges))
        return tok

    # ---- encoding -----------------------------------------------------------------------------------
    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of `text`. special=False: llama.cpp parse_special=false (CONTROL literal, USER_DEFINED
        matched); special=True: CONTROL tokens matched too. BOS/EOS are never added (add_bos_token=false)."""
        text = _check_text(text)
        if not special:
            return self._hf.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        pos = 0
        for m in self.control_token_regex.finditer(text):
            if m.start() > pos:
                ids += self._hf.encode(text[pos:m.start()], add_special_tokens=False).ids
            ids.append(self.added_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self._hf.encode(text[pos:], add_special_tokens=False).ids
        return ids

    def encode_literal(self, text: str) -> list[int]:
        """Ids of `text` with NO added-token matching: `<|im_start|>` or `<think>` become plain BPE text."""
        text = _check_text(text)
        if self.added_token_regex.search(text) is None:
            return self._hf.encode(text, add_special_tokens=False).ids  # nothing the added vocab could match
        return self._encode_without_added(text)

    def _encode_without_added(self, text: str) -> list[int]:
        # The library pipeline minus the added vocabulary: NFC, split + byte-level pre-tokenizer, BPE per piece.
        pieces = self._hf.pre_tokenizer.pre_tokenize_str(unicodedata.normalize("NFC", text))
        model = self._hf.model
        return [t.id for piece, _ in pieces for t in model.tokenize(piece)]

    def encode_chat(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """Ids of a rendered chat given as (text, from_template) pieces (template.RenderedPrompt.pieces).

        Added tokens are matched only inside template pieces, never across two pieces; all text between two
        matched tokens (template text and content alike) is encoded as one literal run, so the ids equal a
        plain special-parsing encode of the whole prompt whenever content holds no added-token text.
        """
        ids: list[int] = []
        run: list[str] = []
        for text, from_template in pieces:
            text = clean_text(text)
            if not from_template:
                run.append(text)
                continue
            pos = 0
            for m in self.added_token_regex.finditer(text):
                run.append(text[pos:m.start()])
                self._flush_literal(run, ids)
                ids.append(self.added_tokens[m.group()])
                pos = m.end()
            run.append(text[pos:])
        self._flush_literal(run, ids)
        return ids

    def _flush_literal(self, run: list[str], ids: list[int]) -> None:
        text = "".join(run)
        run.clear()
        if text:
            ids += self.encode_literal(text)

    # ---- decoding -----------------------------------------------------------------------------------
    def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for. CONTROL tokens give b"" unless special=True; USER_DEFINED tokens
        (<think>, <tool_call> ...) always give their text, since the output parsers need it; UNUSED gives b""."""
        if self._piece_bytes is None:
            self._piece_bytes = self._all_piece_bytes()
        if not 0 <= token_id < self.n_vocab:
            raise InputError(f"token id: {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        if not special and token_id in self.control_ids:
            return b""
        return self._piece_bytes[token_id]

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD (the same rule as the streaming detokenizer)."""
        return b"".join(self.token_bytes(i, special=special) for i in ids).decode("utf-8", "replace")

    def piece(self, token_id: int) -> str:
        """The vocabulary string of a token (byte-level form for BPE tokens, e.g. 'Ġworld')."""
        if not 0 <= token_id < self.n_vocab:
            raise InputError(f"token id: {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.special.eog

    def _all_piece_bytes(self) -> list[bytes]:
        out = []
        for text, ty in zip(self._tokens, self._types, strict=True):
            if ty == TOKEN_NORMAL:
                try:
                    out.append(text.translate(_BYTE_LEVEL_TO_LATIN1).encode("latin-1"))
                except UnicodeEncodeError:  # a char outside the byte-level alphabet: keep its UTF-8
                    out.append(text.encode("utf-8"))
            elif ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
                out.append(text.encode("utf-8"))
            else:
                out.append(b"")
        return out


def _check_text(text: str) -> str:
    if not isinstance(text, str):
        raise InputError(f"text: expected a string, got {type(text).__name__}")
    return clean_text(text)


def _alternation(texts: Iterable[str]) -> re.Pattern[str]:
    ordered = sorted(set(texts), key=len, reverse=True)  # longest first: leftmost-longest match
    return re.compile("|".join(map(re.escape, ordered)) or "(?!)")


def _build_hf_tokenizer(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
                        pre: str) -> _HFTokenizer:
    """The BPE model from Python objects, then the added tokens. Measured side by side on the 248k
    vocabulary (CPU time, median of 5): 0.70 s this way, 1.15 s writing a tokenizer.json string for
    Tokenizer.from_str (the JSON encode and parse cost more than they save)."""
    added = [(i, t, ty == TOKEN_CONTROL) for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
             if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == TOKEN_NORMAL}
    for i, t, _ in added:  # in the model vocab too, so add_tokens keeps the GGUF's ids whatever the layout
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"merge {m!r} has no space")
        pairs.append((left, right))
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX_BY_PRE[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_tokens([AddedToken(t, special=special, normalized=False, single_word=False, lstrip=False,
                               rstrip=False) for _, t, special in added])
    for i, t, _ in added:
        if tok.token_to_id(t) != i:
            raise ValueError(f"added token {t!r} got id {tok.token_to_id(t)}, the file says {i}")
    return tok
