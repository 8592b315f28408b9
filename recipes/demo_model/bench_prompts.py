"""Write held-out chat prompts of the demo model as `mtpchat bench --prompts` JSON lines (token ids,
rendered with the file's own template and tokenizer, ending with the generation prompt)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.gguf import open_gguf
from engine.text.template import ChatTemplate
from engine.text.tokenizer import Tokenizer
from recipes.demo_model import corpus


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=Path("resources/demo-qwen35.gguf"))
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    a.out.write_text("".join(json.dumps({"tokens": t}) + "\n" for t in bench_prompts(a.model, a.n)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
