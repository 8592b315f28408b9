"""Train the demo model on CPU: corpus -> BPE -> joint next-token + MTP training -> checkpoint (issue 6).

Fixed seeds, a fixed step count (never a time budget), the batch order drawn from a seeded generator:
bitwise reproducible with one thread; with two, runs drift apart in the last bits (metrics within
noise). Progress goes to the log (stderr), one line per few steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from pathlib import Path

import torch

from recipes.demo_model import corpus, tokenizer_train
from recipes.demo_model.model import DemoDims, DemoModel

log = logging.getLogger("demo_model.train")

ASSISTANT_OPEN = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"
MTP_WEIGHTS = (0.5, 0.3, 0.3)   # passes 1..3: draft positions 1, 2, 3


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant's own text: after '<|im_start|>assistant\\n' up to and
    including its '<|im_end|>' (the model must learn to stop)."""
    spans, i = [], 0
    while True:
        a = text.find(ASSISTANT_OPEN, i)
        if a < 0:
            return spans
        b = text.find(TURN_END, a)
        end = len(text) if b < 0 else b + len(TURN_END)
        spans.append((a + len(ASSISTANT_OPEN), end))
        i = end


DECISION_CHARS = 12   # the first characters of a reply: empty reasoning, reasoning, or a tool call


def split_generation_prompt(tok, ids: list[int], w: list[float], choice_weight: float = 1.0
                            ) -> tuple[list[int], list[float]]:
    """Tokenize every reply the way chat inference sees it. The generation prompt ends with
    '<think>\\n' = [<think>, \\n] and the model continues from there; but the rendered corpus, encoded in
    one piece, spells an empty reasoning block '<think>\\n\\n</think>' as [<think>, \\n\\n, </think>], so
    [<think>, \\n] was only ever followed by reasoning text -- with tools present, by the reasoning of a
    tool call (plain prompts then drew calls, and the answer after a tool result re-called the tool).
    Here [<think>, \\n\\n, </think>] becomes [<think>, \\n, \\n, </think>], exactly the tokens the engine
    sees (prompt [<think>, \\n] + generated [\\n, </think>, ...]). `choice_weight` is the loss weight of
    the token after [<think>, \\n] in every reply: the choice between an empty and a written reasoning
    block (the written one leads to the tool calls)."""
    think, end_think = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    nl, nlnl = tok.token_to_id("\u010a"), tok.token_to_id("\u010a\u010a")
    oi: list[int] = []
    ow: list[float] = []
    n = len(ids)
    t = 0
    while t < n:
        oi.append(ids[t])
        ow.append(w[t])
        if ids[t] == think and t + 2 < n and ids[t + 1] == nlnl and ids[t + 2] == end_think and w[t] > 0:
            # w[t]: predict the first newline from <think>; the new row predicts the second one (the
            # choice); w[t+1] (predict </think>) moves to the second newline's row
            oi += [nl, nl]
            ow += [choice_weight * w[t], w[t + 1]]
            t += 2
            continue
        if ids[t] == think and t + 1 < n and ids[t + 1] == nl and w[t] > 0:
            oi.append(nl)
            ow.append(choice_weight * w[t + 1])   # predict the first reasoning token (the choice)
            t += 2
            continue
        t += 1
    return oi, ow


def encode_corpus(tok, texts: list[str], decision_weight: float = 1.0, gen_prompt_split: bool = False,
                  choice_weight: float = 1.0) -> list[tuple[list[int], list[float]]]:
    """-> (ids, weights) per conversation; weights[t] = 1 when ids[t+1] is assistant text, and
    `decision_weight` when it is one of the first characters of a reply (where the model decides
    between answering and calling a tool). `gen_prompt_split`: see split_generation_prompt (stages
    1-3 of the shipped recipe ran without it)."""
    out = []
    for text, enc in zip(texts, tok.encode_batch(texts), strict=True):
        spans = assistant_spans(text)
        ids, offsets = enc.ids, enc.offsets   # each property read builds a new list: read them once

        def weight(off: tuple[int, int], spans=spans) -> float:
            for s, e in spans:
                if s <= off[0] < e:
                    return decision_weight if off[0] < s + DECISION_CHARS else 1.0
            return 0.0

        w = [weight(offsets[t + 1]) for t in range(len(ids) - 1)] + [0.0]
        if gen_prompt_split:
            ids, w = split_generation_prompt(tok, ids, w, choice_weight)
        out.append((ids, w))
    return out


def common_prefix(seqs: list[list[int]]) -> list[int]:
    """The longest token prefix shared by all sequences (the tools block of the tool conversations)."""
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        m = 0
        while m < min(n, len(s)) and s[m] == first[m]:
            m += 1
        n = m
    return first[:n]


def split_prefix(samples, has_tools: list[bool]):
    """-> (prefix ids, samples with the prefix cut from the tool conversations, group per sample)."""
    prefix = common_prefix([samples[i][0] for i, t in enumerate(has_tools) if t])
    P = len(prefix)
    out = []
    for (ids, w), t in zip(samples, has_tools, strict=True):
        if t:
            assert ids[:P] == prefix and not any(w[:P])
            ids, w = ids[P:], w[P:]
        out.append((ids, w))
    return prefix, out


def make_batches(samples, groups: list[bool], max_tokens: int, max_len: int, rng: random.Random
                 ) -> list[list[int]]:
    """Length-bucketed batches, one group per batch (rows continue the shared tools prefix or start
    fresh at position 0, as in chat), in a seeded random order."""
    order = sorted(range(len(samples)), key=lambda i: (groups[i], len(samples[i][0])))
    batches, cur, cur_len = [], [], 0
    for i in order:
        n = min(len(samples[i][0]), max_len)
        if cur and (groups[cur[0]] != groups[i] or max(cur_len, n) * (len(cur) + 1) > max_tokens):
            batches.append(cur)
            cur, cur_len = [], 0
        cur.append(i)
        cur_len = max(cur_len, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(samples, idx: list[int], max_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = min(max(len(samples[i][0]) for i in idx), max_len)
    tokens = torch.full((len(idx), T), pad_id, dtype=torch.long)
    weights = torch.zeros(len(idx), T)
    for r, i in enumerate(idx):
        ids, w = samples[i]
        n = min(len(ids), T)
        tokens[r, :n] = torch.tensor(ids[:n])
        weights[r, :n] = torch.tensor(w[:n])
        weights[r, n - 1] = 0.0
    return tokens, weights


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def train(out_dir: Path, *, steps: int, n_conv: int, max_tokens: int, max_len: int, lr: float,
          seed: int, threads: int, log_every: int = 10, stop_after: int | None = None,
          init_from: Path | None = None, decision_weight: float = 1.0, gen_prompt_split: bool = False,
          choice_weight: float = 1.0, topic_weights: dict[str, float] | None = None) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    texts = corpus.corpus_texts("train", n_conv)
    tok = tokenizer_train.build_tokenizer(texts[: tokenizer_train.N_TEXTS])   # always the stage-1 corpus
    tok.save(str(out_dir / "tokenizer.json"))
    if init_from is not None and (init_from.parent / "tokenizer.json").is_file():
        if (init_from.parent / "tokenizer.json").read_bytes() != (out_dir / "tokenizer.json").read_bytes():
            raise RuntimeError(f"tokenizer differs from the one {init_from} was trained with")
    if topic_weights:                # a later stage's mix: other conversations, same vocabulary
        texts = corpus.corpus_texts("train", n_conv, topic_weights=topic_weights)
    has_tools = [corpus.make_conversation("train", i, topic_weights=topic_weights).tools is not None
                 for i in range(n_conv)]
    prefix, samples = split_prefix(encode_corpus(tok, texts, decision_weight, gen_prompt_split, choice_weight),
                                   has_tools)
    prefix_tokens = torch.tensor([prefix])
    pad_id = tok.token_to_id("<|endoftext|>")
    t_data = time.monotonic() - t0
    log.info("corpus: %d conversations, %d tokens after the shared %d-token tools prefix (%d trained), "
             "data %.1fs", len(samples), sum(len(s[0]) for s in samples), len(prefix),
             int(sum(sum(s[1]) for s in samples)), t_data)

    if init_from is not None:        # a further stage: same corpus and vocabulary, new schedule
        model = load_checkpoint(init_from)
        dims = model.dims
        log.info("continuing from %s", init_from)
    else:
        dims = DemoDims()
        model = DemoModel(dims)
        model.init_weights(torch.Generator().manual_seed(seed))
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or "parametrizations" in name else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    rng = random.Random(seed)
    batches: list[list[int]] = []
    history = []
    t_train = time.monotonic()
    for step in range(steps if stop_after is None else min(steps, stop_after)):
        if not batches:
            batches = make_batches(samples, has_tools, max_tokens, max_len, rng)
        idx = batches.pop()
        tokens, weights = collate(samples, idx, max_len, pad_id)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        losses = model.losses(tokens, weights, n_pass=len(MTP_WEIGHTS),
                              prefix_tokens=prefix_tokens if has_tools[idx[0]] else None)
        loss = losses["main"] + sum(wt * losses[f"mtp{p}"] for p, wt in enumerate(MTP_WEIGHTS, start=1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rec = {k: round(float(v.detach()), 4) for k, v in losses.items()}
        rec.update(step=step, tokens=int(tokens.numel()), tools=has_tools[idx[0]], elapsed=round(time.monotonic() - t_train, 1))
        history.append(rec)
        if step % log_every == 0 or step == steps - 1:
            log.info("step %d/%d %s", step, steps, rec)
        if (step + 1) % 40 == 0 and step + 1 < steps:   # a partial checkpoint to evaluate early
            torch.save({"state_dict": model.state_dict(), "dims": dims.__dict__, "seed": seed, "steps": step + 1},
                       out_dir / "checkpoint-partial.pt")
    train_s = time.monotonic() - t_train
    if stop_after is not None:    # a reproducibility probe: the first steps of the same schedule
        (out_dir / "probe_log.json").write_text(json.dumps({"stop_after": stop_after, "history": history}))
        return {"steps": steps, "stop_after": stop_after, "train_s": round(train_s, 1), "history": history}
    torch.save({"state_dict": model.state_dict(), "dims": dims.__dict__, "seed": seed, "steps": steps},
               out_dir / "checkpoint.pt")
    summary = {"steps": steps, "n_conv": n_conv, "max_tokens": max_tokens, "lr": lr, "seed": seed,
               "gen_prompt_split": gen_prompt_split, "choice_weight": choice_weight,
               "topic_weights": topic_weights,
               "threads": threads, "data_s": round(t_data, 1), "train_s": round(train_s, 1),
               "final": history[-1], "history": history}
    (out_dir / "train_log.json").write_text(json.dumps(summary, indent=1))
    return summary


def load_checkpoint(path: Path) -> DemoModel:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    model = DemoModel(DemoDims(**{k: tuple(v) if isinstance(v, list) else v for k, v in ck["dims"].items()}))
    model.init_weights(torch.Generator().manual_seed(0))   # registers the ssm_a parametrization
    model.load_state_dict(ck["state_dict"])
    return model


def _topic_weights(specs: list[str]) -> dict[str, float] | None:
    out = {}
    for spec in specs:
        name, _, w = spec.partition("=")
        if name not in corpus.TOPICS or not w:
            raise SystemExit(f"--topic-weight: expected TOPIC=W with TOPIC in {sorted(corpus.TOPICS)}, got {spec!r}")
        out[name] = float(w)
    return out or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train the bundled demo model (CPU).")
    p.add_argument("--out", type=Path, default=Path("recipes/demo_model/build"))
    p.add_argument("--steps", type=int, default=280)
    p.add_argument("--n-conv", type=int, default=12000)
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch (padded)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads; the result's bits depend on it (the shipped file: 2, as build.sh)")
    p.add_argument("--init-from", type=Path, default=None, help="start from this checkpoint (a second stage)")
    p.add_argument("--decision-weight", type=float, default=1.0,
                   help="loss weight of the first characters of each reply (answer or tool call)")
    p.add_argument("--gen-prompt-split", action="store_true",
                   help="tokenize each reply as chat inference does: [<think>, \\n] then the reply "
                        "(an empty reasoning block as \\n \\n </think>, not \\n\\n </think>)")
    p.add_argument("--choice-weight", type=float, default=1.0,
                   help="with --gen-prompt-split: loss weight of the token after [<think>, \\n] "
                        "(empty or written reasoning, i.e. answer or tool call)")
    p.add_argument("--topic-weight", action="append", default=[], metavar="TOPIC=W",
                   help="override a topic's weight in corpus.TOPICS for this stage (repeatable)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="run only the first N steps of the schedule (reproducibility probe; no checkpoint)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    s = train(a.out, steps=a.steps, n_conv=a.n_conv, max_tokens=a.max_tokens, max_len=a.max_len, lr=a.lr,
              seed=a.seed, threads=a.threads, stop_after=a.stop_after,
              init_from=a.init_from, decision_weight=a.decision_weight,
              gen_prompt_split=a.gen_prompt_split, choice_weight=a.choice_weight,
              topic_weights=_topic_weights(a.topic_weight))
    log.info("done: %s", {k: v for k, v in s.items() if k != "history"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
