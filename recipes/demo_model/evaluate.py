"""Acceptance metrics of the demo GGUF on the held-out split (issue 6), through the engine's own path:
GGUF loader, tokenizer and chat template from the file, greedy decoding, the output parser.

- tool prompts: a well-formed, schema-valid tool call; plain prompts: no tool call;
- follow-up turns: the conversation cut right after the first tool result; the answer must make no new
  call and must contain the result (the number, the local time, the file's lines or the missing name);
- MTP: per-position acceptance and mean acceptance length at k = 3 of greedy speculative rounds,
  computed exactly from one teacher-forced pass over prompt + greedy output (the drafts of a round
  only matter while the earlier ones match the greedy tokens, and those are the teacher's tokens).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from engine.generate import generate
from engine.gguf import open_gguf
from engine.model import load_model
from engine.text.output import OutputParser
from engine.text.template import ChatTemplate
from engine.text.tokenizer import Tokenizer
from recipes.demo_model import corpus
from recipes.demo_model.model import DemoModel


def schema_valid(call: dict[str, Any], tools: list[dict[str, Any]]) -> bool:
    """Name declared, required parameters present, no undeclared ones, JSON types as the schema says."""
    fn = call["function"]
    spec = next((t["function"] for t in tools if t["function"]["name"] == fn["name"]), None)
    if spec is None:
        return False
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return False
    props, required = spec["parameters"]["properties"], spec["parameters"].get("required", [])
    if not isinstance(args, dict) or any(r not in args for r in required) or any(a not in props for a in args):
        return False
    for name, value in args.items():
        want = props[name].get("type")
        if want == "string" and not isinstance(value, str):
            return False
        if want == "number" and (isinstance(value, bool) or not isinstance(value, int | float)):
            return False
    return True


def result_strings(tool_content: str) -> list[str]:
    """What a follow-up answer must quote from a tool result (the corpus's tool results)."""
    try:
        res = json.loads(tool_content)
    except json.JSONDecodeError:
        res = None
    if not isinstance(res, dict):                      # read_file: the file's text
        return [line for line in tool_content.splitlines() if line.strip()]
    if "error" in res:                                 # read_file: file not found -> name the file
        return [res["error"].rsplit(": ", 1)[-1]]
    if "datetime" in res:                              # get_current_time: the local HH:MM
        return [res["datetime"][11:16]]
    return [corpus._fmt_num(res["result"])]            # calculator, convert_units


def followup_prompts(n: int) -> list[tuple[Any, list[dict[str, Any]], list[str]]]:
    """Held-out tool dialogues cut after the first tool result: (conversation, messages, must quote)."""
    out, i = [], 0
    while len(out) < n:
        conv = corpus.make_conversation("test", i)
        i += 1
        if not conv.last.uses_tool:
            continue
        j = max(k for k, m in enumerate(conv.messages) if m["role"] == "tool")
        out.append((conv, conv.messages[: j + 1], result_strings(conv.messages[j]["content"])))
    return out


def draft_table(wrapper: DemoModel, ids: list[int], k: int) -> torch.Tensor:
    """[k, n] argmax drafts: row p-1, column i = draft step p at position i (predicts x_{i+1})."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        h = wrapper.trunk(x)
        hms = wrapper.mtp_passes(x, h, k)
        return torch.stack([wrapper.net.head(hm[0]).argmax(-1) for hm in hms])


def simulate_rounds(ids: list[int], n_prompt: int, drafts: torch.Tensor, k: int) -> list[tuple[int, int]]:
    """Greedy speculative rounds over the greedy output ids[n_prompt:]: (k used, accepted) per round.
    The first output token comes from the prefill; each round starts from the pending token s0 = x_P."""
    n = len(ids)
    rounds, P = [], n_prompt
    d = drafts.tolist()
    while P < n - 1:
        kk = min(k, n - 1 - P)
        a = 0
        while a < kk and d[a][P + a] == ids[P + a + 1]:
            a += 1
        rounds.append((kk, a))
        P += a + 1
    return rounds


def evaluate(gguf_path: Path, n_tool: int, n_plain: int, max_tokens: int = 160, k: int = 3,
             threads: int = 1, n_followup: int = 0) -> dict[str, Any]:
    torch.set_num_threads(threads)
    f = open_gguf(gguf_path)
    model = load_model(f)
    tok = Tokenizer.from_gguf(f)
    tmpl = ChatTemplate.from_tokenizer_metadata(f.metadata, tok)
    wrapper = DemoModel.wrap(model)
    stop = [i for i in range(tok.n_vocab) if tok.is_eog(i)]
    picked: dict[bool, list] = {True: [], False: []}
    want = {True: n_tool, False: n_plain}
    i = 0
    while len(picked[True]) < n_tool or len(picked[False]) < n_plain:
        conv = corpus.make_conversation("test", i)
        i += 1
        ep = corpus.eval_prompt(conv)
        if len(picked[ep.expects_tool]) < want[ep.expects_tool]:
            picked[ep.expects_tool].append((conv, ep))
    def answer(messages, tools, corpus_text: str):
        """Greedy reply of the engine to `messages` (rendered by the file's template, which must equal
        the corpus render) -> (prompt ids, generation result, parsed output)."""
        rp = tmpl.render(messages, tools, add_generation_prompt=True)
        assert rp.text == corpus_text, "engine template render differs from the corpus render"
        prompt = tok.encode_chat(rp.pieces)
        res = generate(model, prompt, max_tokens=max_tokens, stop_ids=stop)
        parser = OutputParser(tools, thinking_open=True)
        parser.feed(tok.decode(res.tokens))
        parser.finish()
        return prompt, res, parser.result()

    rows = []
    rounds_all: list[tuple[int, int]] = []
    t0 = time.monotonic()
    for expects_tool in (True, False):
        for conv, ep in picked[expects_tool]:
            last_user = max(j for j, m in enumerate(conv.messages) if m["role"] == "user")
            prompt, res, out = answer(conv.messages[: last_user + 1], conv.tools, ep.text)
            calls = out.tool_calls
            valid = bool(calls) and not out.malformed and not out.truncated and \
                all(schema_valid(c, conv.tools or []) for c in calls)
            exact = bool(calls) and ep.expected_call is not None and \
                calls[0]["function"]["name"] == ep.expected_call["name"] and \
                json.loads(calls[0]["function"]["arguments"]) == ep.expected_call["arguments"]
            ids = prompt + res.tokens
            rounds = simulate_rounds(ids, len(prompt), draft_table(wrapper, ids, k), k)
            rounds_all += rounds
            rows.append({"kind": ep.kind, "tools": ep.has_tools, "expects_tool": expects_tool,
                         "n_calls": len(calls), "valid_call": valid, "exact_call": exact,
                         "spurious": (not expects_tool) and ("<tool_call>" in out.content or bool(calls)),
                         "finish": res.finish_reason, "n_out": len(res.tokens), "user": ep.user,
                         "output": tok.decode(res.tokens)})
    follow_rows = []
    for conv, msgs, quote in followup_prompts(n_followup):
        _, res, out = answer(msgs, conv.tools, corpus.render(msgs, conv.tools, add_generation_prompt=True))
        no_call = not out.tool_calls and "<tool_call>" not in out.content
        follow_rows.append({"kind": conv.last.kind, "no_call": no_call,
                            "uses_result": no_call and all(q in out.content for q in quote),
                            "must_quote": quote, "finish": res.finish_reason, "user": conv.last.user,
                            "output": tok.decode(res.tokens)})
    tool_rows = [r for r in rows if r["expects_tool"]]
    plain_rows = [r for r in rows if not r["expects_tool"]]
    drafted = [0] * k
    accepted = [0] * k
    for kk, a in rounds_all:
        for j in range(kk):
            drafted[j] += 1
            accepted[j] += j < a
    full = [(kk, a) for kk, a in rounds_all if kk == k]
    train_users = {e.user for c in (corpus.make_conversation("train", j) for j in range(12000))
                   for e in c.exchanges}
    return {
        "model": str(gguf_path), "n_tool_prompts": len(tool_rows), "n_plain_prompts": len(plain_rows),
        "tool_call_valid_rate": sum(r["valid_call"] for r in tool_rows) / max(1, len(tool_rows)),
        "tool_call_exact_rate": sum(r["exact_call"] for r in tool_rows) / max(1, len(tool_rows)),
        "plain_no_tool_call_rate": sum(not r["spurious"] for r in plain_rows) / max(1, len(plain_rows)),
        "finished_rate": sum(r["finish"] == "stop" for r in rows) / max(1, len(rows)),
        "mtp_k": k, "rounds": len(rounds_all),
        "accepted_per_position": [accepted[j] / max(1, drafted[j]) for j in range(k)],
        "mean_acceptance_length": sum(a + 1 for _, a in full) / max(1, len(full)),
        "n_followup_prompts": len(follow_rows),
        "followup_no_call_rate": sum(r["no_call"] for r in follow_rows) / max(1, len(follow_rows)),
        "followup_uses_result_rate": sum(r["uses_result"] for r in follow_rows) / max(1, len(follow_rows)),
        "plain_no_tool_call_rate_by_kind": _by_kind(plain_rows),
        "held_out_user_prompts_seen_in_train": sum(r["user"] in train_users for r in rows) / max(1, len(rows)),
        "eval_s": round(time.monotonic() - t0, 1), "rows": rows, "followup_rows": follow_rows,
    }


def _by_kind(plain_rows: list[dict[str, Any]]) -> dict[str, str]:
    """'clean/total' per (kind, tools block present) of the plain prompts."""
    out: dict[str, list[int]] = {}
    for r in plain_rows:
        c = out.setdefault(f"{r['kind']}{'+tools' if r['tools'] else ''}", [0, 0])
        c[0] += not r["spurious"]
        c[1] += 1
    return {key: f"{a}/{b}" for key, (a, b) in sorted(out.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Held-out acceptance metrics of the demo model.")
    p.add_argument("--model", type=Path, default=Path("resources/demo-qwen35.gguf"))
    p.add_argument("--n-tool", type=int, default=150)
    p.add_argument("--n-plain", type=int, default=150)
    p.add_argument("--n-followup", type=int, default=100,
                   help="held-out tool dialogues cut after the tool result (0: skip)")
    p.add_argument("--out", type=Path, default=None, help="write the full report (JSON) here")
    a = p.parse_args(argv)
    rep = evaluate(a.model, a.n_tool, a.n_plain, n_followup=a.n_followup)
    if a.out:
        a.out.write_text(json.dumps(rep, indent=1))
    print(json.dumps({k: v for k, v in rep.items() if k not in ("rows", "followup_rows")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
