"""Write held-out chat prompts of the demo model as `mtpchat bench --prompts` JSON lines (token ids,
rendered with the file's own template and tokenizer, ending with the generation prompt); with
--random-tokens L, prompts of L random token ids instead (no template, no control tokens): text the model was not
trained to continue, where its MTP drafts are poor (demo model, k = 3: acceptance ~0.5 / 0.3 / 0.25 per
position against ~0.95 / 0.9 / 0.85 on the chat prompts), the set the 'poor drafts' bars are measured on."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from engine.gguf import open_gguf
from engine.text.template import ChatTemplate
from engine.text.tokenizer import Tokenizer
from recipes.demo_model import corpus

CONTROL = 3   # GGUF token type


def bench_prompts(gguf_path: Path, n: int = 8) -> list[list[int]]:
    f = open_gguf(gguf_path)
    tok = Tokenizer.from_gguf(f)
    tmpl = ChatTemplate.from_tokenizer_metadata(f.metadata, tok)
    out, i = [], 0
    while len(out) < n:
        conv = corpus.make_conversation("test", 10_000 + i)   # beyond the evaluated test prompts
        i += 1
        last_user = max(j for j, m in enumerate(conv.messages) if m["role"] == "user")
        rp = tmpl.render(conv.messages[: last_user + 1], conv.tools, add_generation_prompt=True)
        out.append(tok.encode_chat(rp.pieces))
    return out


def random_prompts(gguf_path: Path, n: int = 8, length: int = 32, seed: int = 7) -> list[list[int]]:
    """n prompts of `length` token ids drawn uniformly (seeded) from every token but the CONTROL ones
    (which would end or restructure the text): ordinary ones and the vocabulary's unused and added ones."""
    tok = Tokenizer.from_gguf(open_gguf(gguf_path))
    ids = [i for i in range(tok.n_vocab) if tok.token_type(i) != CONTROL]
    rng = random.Random(seed)
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=Path("resources/demo-qwen35.gguf"))
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--random-tokens", type=int, metavar="L", help="prompts of L random token ids (no control tokens)")
    p.add_argument("--seed", type=int, default=7, help="seed of --random-tokens (default 7)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.random_tokens is not None and a.random_tokens < 1:
        p.error(f"--random-tokens: must be >= 1, got {a.random_tokens}")
    prompts = (bench_prompts(a.model, a.n) if a.random_tokens is None
               else random_prompts(a.model, a.n, a.random_tokens, a.seed))
    a.out.write_text("".join(json.dumps({"tokens": t}) + "\n" for t in prompts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
