"""The speculative decode loop: N sequences in one `ModelCache`, each round drafting k tokens with the
MTP head, verifying them in one batched main pass, accepting, rolling back (spec/mtp-speculation.md).

Invariants: the MTP cache of a slot holds E(0..n-1) for the n committed tokens (§1.1: entry p pairs
token p with the main hidden state of p-1, zero for p = 0) and the carry is h(n-1); plain steps keep
both in sync (§5.3). One host read per round (drafts, targets and accepted counts together).
Never prints: `SpecDecoder.stream` yields a `RoundEvent` per round / plain step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InputError
from engine.model import ModelCache, Qwen35Model, shift_hidden
from engine.sampling import Sampler, SamplingParams
from engine.spec.events import RoundEvent, SpecStats
from engine.spec.gate import AdaptiveGate, Decision, DraftController, FixedPolicy, RoundTiming
from engine.spec.modes import HIDDEN_MODES, MTP_MODES, ROLLBACK_MODES
from engine.spec.policy import AutoPolicy
from engine.spec.rejection import (
    accepted_count,
    accepted_prefix,
    draw_uniforms,
    inverse_cdf,
    sample_and_compare,
)
from engine.spec.stops import StopChecker, StopRule

MTP_QUEUE_MAX = 256

# A draft hook sees (slot, P, drafts [k] long on the device, targets unknown) and returns the drafts to
# verify: tests force rejections with it, `bench --wrong-drafts` measures pure overhead.
DraftHook = Callable[[int, int, torch.Tensor], torch.Tensor]


def make_controller(mode: str, n_draft: int) -> DraftController:
    """`--mtp off|on|adaptive|auto` with `--draft K` (for auto, K is the largest k it may choose)."""
    if mode not in MTP_MODES:
        raise InputError(f"mtp: unknown mode {mode!r} (one of {', '.join(MTP_MODES)})")
    if not 1 <= n_draft <= 8:
        raise InputError(f"draft: must be in 1..8, got {n_draft}")
    if mode == "off":
        return FixedPolicy(0)
    if mode == "on":
        return FixedPolicy(n_draft)
    if mode == "adaptive":
        return AdaptiveGate(n_draft)
    return AutoPolicy(k_max=n_draft)


@dataclass
class SpecOptions:
    mode: str = "auto"
    n_draft: int = 3                   # k for on/adaptive, k_max for auto
    hidden: str = "post-norm"          # which main hidden feeds the MTP head (spec §6.2)
    rollback: str = "per_step"         # per-step GDN states from the verification, or restore + re-decode
    prefill_chunk: int | None = None   # prompt tokens per prefill forward (None: the whole prompt)
    delta_chunk: int = 64
    draft_hook: DraftHook | None = None
    # the clock of every timing (events, policies): wall time by default; `time.thread_time` measures
    # this thread's CPU time, which a one-thread CPU benchmark on a shared machine needs
    clock: Callable[[], float] = time.perf_counter
    # plain steps queue their MTP entries and write them in one batch before the next draft and at 256
    # queued rows (spec §5.3 "lazily"; `sync_mtp()` writes them on demand, e.g. before the cache is
    # reused); False writes one row per step
    lazy_mtp_sync: bool = True
    # sequence index -> its draft controller (default: a fresh one per sequence from mode/n_draft); the
    # bench passes one `auto` policy per configuration, kept across runs as a server slot keeps it
    controller_factory: Callable[[int], DraftController] | None = None

    def __post_init__(self):
        if self.hidden not in HIDDEN_MODES:
            raise InputError(f"mtp-hidden: one of {', '.join(HIDDEN_MODES)}, got {self.hidden!r}")
        if self.rollback not in ROLLBACK_MODES:
            raise InputError(f"rollback: one of {', '.join(ROLLBACK_MODES)}, got {self.rollback!r}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise InputError(f"prefill-chunk: must be >= 1, got {self.prefill_chunk}")
        make_controller(self.mode, self.n_draft)


@dataclass
class SeqResult:
    tokens: list[int]
    finish_reason: str
    stats: SpecStats
    prompt_tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    text_bytes: bytes = b""

    @property
    def decode_tokens_per_second(self) -> float:
        n = len(self.tokens) - 1   # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0


@dataclass
class _Seq:
    index: int
    slot: int
    prompt: list[int]
    checker: StopChecker
    controller: DraftController
    sampler: Sampler
    stats: SpecStats = field(default_factory=SpecStats)
    pending: int = -1                  # s0: emitted, not yet in the main cache
    carry: torch.Tensor | None = None  # h(n-1) [E] for the MTP head
    uniforms: torch.Tensor | None = None  # [max_tokens] float64: the draw for generated token t
    # MTP entries not yet written (spec §5.3, lazy form; plain steps' and a round's accepted drafts): tokens and
    # their hidden rows h(q-1), as blocks [n, E] (a round's accepted rows are one block, a view of its verification's)
    mtp_queue: list[int] = field(default_factory=list)
    mtp_queue_hidden: list[torch.Tensor] = field(default_factory=list)
    n_past: int = 0                    # committed tokens in the main cache
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.checker.done


class SpecDecoder:
    """Greedy or sampled generation with MTP speculation for one or more sequences at once."""

    def __init__(self, model: Qwen35Model, options: SpecOptions | None = None):
        self.model = model
        self.opt = options or SpecOptions()
        self.cache: ModelCache | None = None
        self.seqs: list[_Seq] = []

    @property
    def uses_mtp(self) -> bool:
        return self.model.cfg.has_mtp and self.opt.mode != "off"

    # ------------------------------------------------------------------ public API

    def generate(self, prompts: Sequence[Sequence[int]], rule: StopRule, sampling: SamplingParams = SamplingParams(),
                 token_bytes: Callable[[int], bytes] | None = None) -> list[SeqResult]:
        for _ in self.stream(prompts, rule, sampling, token_bytes):
            pass
        return self.results()

    def results(self) -> list[SeqResult]:
        return [SeqResult(list(s.checker.tokens), s.checker.finish_reason or "length", s.stats, len(s.prompt),
                          s.prefill_s, s.decode_s, s.checker.output_bytes()) for s in self.seqs]

    def stream(self, prompts: Sequence[Sequence[int]], rule: StopRule, sampling: SamplingParams = SamplingParams(),
               token_bytes: Callable[[int], bytes] | None = None) -> Iterator[RoundEvent]:
        """Prefill every prompt (MTP warm-up inside the prefill), then decode all sequences until each
        stops; yields one event per plain step or round of every sequence."""
        cfg = self.model.cfg
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InputError("prompt: at least one token is needed")
        for p in prompts:
            bad = [t for t in p if not 0 <= t < cfg.n_vocab]
            if bad:
                raise InputError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{cfg.n_vocab - 1})")
        if rule.max_tokens < 1:
            raise InputError(f"max_tokens: must be >= 1, got {rule.max_tokens}")
        n_ctx = max(len(p) for p in prompts) + rule.max_tokens + 10
        self.cache = ModelCache(cfg, len(prompts), n_ctx, device=self.model.device, kv_dtype=torch.float32,
                                mtp=self.uses_mtp)
        self.seqs = []
        for i, p in enumerate(prompts):
            seed = None if sampling.seed is None else sampling.seed + i
            smp = Sampler(dataclasses.replace(sampling, seed=seed), self.model.device)
            if self.opt.controller_factory is not None and self.uses_mtp:
                ctl = self.opt.controller_factory(i)
            else:
                ctl = make_controller(self.opt.mode if self.uses_mtp else "off", self.opt.n_draft)
            seq = _Seq(i, i, list(p), StopChecker(rule, token_bytes), ctl, smp)
            if not sampling.greedy:
                # one uniform per generated position, drawn up front: token t is always the inverse CDF of
                # its distribution at u[t], whatever k each round used (reproducible in every mode, F5)
                seq.uniforms = draw_uniforms(rule.max_tokens + 1, 1, smp.generator, self.model.device)[:, 0]
            self.seqs.append(seq)
        with torch.inference_mode():
            for s in self.seqs:
                self._prefill(s)
            while True:
                active = [s for s in self.seqs if not s.done]
                if not active:
                    return
                groups: dict[int, list[tuple[_Seq, Decision]]] = {}
                for s in active:
                    k_cap = max(0, min(s.checker.remaining - 1, self.cache.n_ctx - s.n_past - 2))
                    dec = s.controller.decide(k_cap)
                    groups.setdefault(dec.k, []).append((s, dec))
                for k in sorted(groups):
                    group = groups[k]
                    yield from (self._plain(group) if k == 0 else self._round(group, k))

    # ------------------------------------------------------------------ pieces

    def _hidden(self, out) -> torch.Tensor:
        return out.hidden if self.opt.hidden == "post-norm" else out.hidden_prenorm

    def _uniforms(self, s: _Seq, n: int) -> torch.Tensor:
        """[n, 1] draws for the next n generated positions."""
        t = len(s.checker.tokens)
        return s.uniforms[t:t + n, None]

    def _sample_rows(self, s: _Seq, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] -> [1] token on the device: argmax, or the plain pipeline's distribution
        (engine.sampling) at the position's uniform."""
        if s.sampler.params.greedy:
            return logits.argmax(dim=-1)
        return inverse_cdf(s.sampler.probs(logits), self._uniforms(s, logits.shape[0]))[:, 0]

    def _prefill(self, s: _Seq) -> None:
        t0 = self.opt.clock()
        m, cache = self.model, self.cache
        toks = torch.tensor([s.prompt], dtype=torch.long, device=m.device)
        step = self.opt.prefill_chunk or len(s.prompt)
        out = None
        for c0 in range(0, len(s.prompt), step):
            piece = toks[:, c0:c0 + step]
            last = c0 + step >= len(s.prompt)
            out = m.forward(piece, cache, [s.slot], logits="last" if last else "none", chunk=self.opt.delta_chunk)
            if self.uses_mtp:
                # MTP warm-up of this piece: E(q) = (x_q, h(q-1)), row 0 paired with the carry (spec §1.3)
                h = self._hidden(out)
                prev = None if s.carry is None else s.carry[None]
                m.mtp_forward(piece, shift_hidden(h, prev), cache, [s.slot], logits="none")
                s.carry = h[0, -1].clone()
        s.n_past = len(s.prompt)
        first = int(self._sample_rows(s, out.logits[:, -1])[0])
        s.pending = first
        s.checker.push(first)
        s.prefill_s = self.opt.clock() - t0

    def _plain(self, group: list[tuple[_Seq, Decision]]) -> Iterator[RoundEvent]:
        """One plain step for every sequence of the group in one forward (and one MTP sync pass)."""
        t0 = self.opt.clock()
        m, cache = self.model, self.cache
        u0 = m.untimed_calls
        seqs = [s for s, _ in group]
        slots = [s.slot for s in seqs]
        x = torch.tensor([[s.pending] for s in seqs], dtype=torch.long, device=m.device)
        out = m.forward(x, cache, slots, logits="all", chunk=self.opt.delta_chunk)
        h = self._hidden(out)
        if self.uses_mtp and not self.opt.lazy_mtp_sync:   # spec §5.3: E(q) = (x_q, carry), carry = h(q)
            carry = torch.stack([s.carry for s in seqs])[:, None]
            m.mtp_forward(x, carry, cache, slots, logits="none")
        nxt = [self._sample_rows(s, out.logits[i]) for i, s in enumerate(seqs)]
        nxt = torch.cat(nxt).tolist()
        dt = self.opt.clock() - t0
        timed = m.untimed_calls == u0           # no compile, no eager call beside one (RoundTiming.timed)
        for i, (s, dec) in enumerate(group):
            s.n_past += 1
            if self.uses_mtp:
                if self.opt.lazy_mtp_sync:
                    s.mtp_queue.append(s.pending)
                    s.mtp_queue_hidden.append(s.carry[None])
                    if len(s.mtp_queue) >= MTP_QUEUE_MAX:
                        t1 = self.opt.clock()
                        self._flush_mtp(s)
                        s.decode_s += self.opt.clock() - t1
                s.carry = h[i, 0].clone()
            s.pending = nxt[i]
            s.checker.push(nxt[i])
            s.decode_s += dt
            yield self._event(s, dec, 0, 0, 1, RoundTiming(0.0, dt, 0.0), "none", plain_s=dt if timed else 0.0)

    def _round(self, group: list[tuple[_Seq, Decision]], k: int) -> Iterator[RoundEvent]:
        """Draft k tokens per sequence, verify [s0, d1..dk] in one pass, accept, roll back (§2, §3)."""
        m, cache, opt = self.model, self.cache, self.opt
        seqs = [s for s, _ in group]
        slots = [s.slot for s in seqs]
        # a round drafts and verifies in one compiled call (see `fused` below); drafts are greedy whatever the
        # sampling, and a sampled round draws its rows from the call's logits (spec §3.3)
        fusable = m.steps_status[0] == "compiled" and opt.draft_hook is None and opt.rollback == "per_step"
        # draft step 1 writes the queued entries (the last round's accepted drafts, a few plain steps' entries):
        # up to k, or for one sequence as many as its padded step 1 holds (one compiled graph per k:
        # `Qwen35Model.step1_pad`)
        backlog_max = m.step1_queue_max(k) if len(seqs) == 1 else k
        for s in seqs:
            if len(s.mtp_queue) > backlog_max:
                # a longer backlog (plain-step entries) is written outside the round's timer: it is the plain
                # steps' MTP sync (paid whatever k is), not a cost of drafting that policies should see
                t = self.opt.clock()
                self._flush_mtp(s)
                s.decode_s += self.opt.clock() - t
        t0 = self.opt.clock()
        u0 = m.untimed_calls
        P = [s.n_past for s in seqs]
        # draft step 1 also writes the queued entries (plain steps, the last round's accepted drafts) in
        # the same MTP pass: rows [queue..., s0] with hidden [queue_hidden..., carry], head on the last
        # row only; then steps 2..k. One `draft_chain` call (one compiled graph), or one per step-1 length where
        # they cannot be padded to one; device argmax, no host sync per draft token (spec §2)
        d_rows: list[torch.Tensor | None] = [None] * len(seqs)
        # several sequences pad their step 1 to one length (`Qwen35Model.step1_pads`): one call for all; else
        # (eager steps for one sequence, rows at the cache's end) one call per step-1 length
        pads = m.step1_pads(cache, slots, [len(s.mtp_queue) + 1 for s in seqs], k) if len(seqs) > 1 else None
        if pads is not None:
            parts = [(list(range(len(seqs))), pads)]
        else:
            by_len: dict[int, list[int]] = {}
            for i, s in enumerate(seqs):
                by_len.setdefault(len(s.mtp_queue), []).append(i)
            # one sequence's step 1 is padded to one length per k (one compiled graph)
            parts = [(idx, [m.step1_pad(cache, seqs[idx[0]].slot, len(seqs[idx[0]].mtp_queue) + 1, k)
                            if len(idx) == 1 else 0] * len(idx)) for idx in by_len.values()]
        # a round whose rows share one step-1 length drafts and verifies in one call (one compiled graph): its
        # time is all verify_s (draft_s 0), the drafting being inside the call
        fused = fusable and len(parts) == 1
        out = targets = None
        for idx, pad in parts:
            # padding rows (the pending token and its carry) go before the pending row (`Qwen35Model.step1_pad`)
            x = torch.tensor([seqs[i].mtp_queue + [seqs[i].pending] * (p + 1) for i, p in zip(idx, pad, strict=True)],
                             dtype=torch.long, device=m.device)
            hin = [self._queue_hidden(seqs[i], with_carry=True, pad=p) for i, p in zip(idx, pad, strict=True)]
            hin = hin[0][None] if len(hin) == 1 else torch.stack(hin)
            if fused:
                d, out, targets = m.draft_and_verify(x, hin, cache, slots, k, chunk=opt.delta_chunk, pad=pad)
            else:
                dr, _ = m.draft_chain(x, hin, cache, [slots[i] for i in idx], k, pad=pad)
                for j, i in enumerate(idx):
                    d_rows[i] = dr[j]
            for i in idx:
                seqs[i].mtp_queue.clear()
                seqs[i].mtp_queue_hidden.clear()
        for s, p in zip(seqs, P, strict=True):
            cache.truncate_mtp(s.slot, p + 1)     # keep E(P) of step 1, drop the scratch entries
        if fused:
            t1 = t0
        else:
            d = torch.stack(d_rows)               # [B, k]
            if opt.draft_hook is not None:
                d = torch.stack([opt.draft_hook(s.slot, p, d[i]) for i, (s, p) in enumerate(zip(seqs, P, strict=True))])
            t1 = self.opt.clock()
            snaps = [cache.snapshot_gdn(s.slot) for s in seqs] if opt.rollback == "redecode" else None
            s0 = torch.tensor([[s.pending] for s in seqs], dtype=torch.long, device=m.device)
            rows = torch.cat([s0, d], dim=1)      # [B, k+1] at positions P..P+k
            out = m.forward(rows, cache, slots, logits="all", chunk=opt.delta_chunk,
                            gdn_steps=opt.rollback == "per_step")
        h = self._hidden(out)
        if targets is not None and all(s.sampler.params.greedy for s in seqs):
            # drafts and targets in one host read; the accepted prefix counted here
            host = []
            for row in torch.cat([d, targets], dim=1).tolist():
                host.append([accepted_count(row[:k], row[k:]), *row[k:]])
        else:
            # acceptance on the device, then the round's one host read
            packed = []
            for i, s in enumerate(seqs):
                if s.sampler.params.greedy:
                    target = out.logits[i].argmax(dim=-1)                              # [k+1]
                    a = accepted_prefix(target, d[i])
                else:
                    # spec §3.3 sample-and-compare: row j drawn at the uniform of its position
                    a, y = sample_and_compare(s.sampler.probs(out.logits[i]), d[i], self._uniforms(s, k + 1))
                    target, a = y[:, 0], a[0]
                packed.append(torch.cat([a.reshape(1), target]))
            host = torch.stack(packed).tolist()
        t2 = self.opt.clock()
        commits = []
        for i, s in enumerate(seqs):
            a, target = host[i][0], host[i][1:]
            ids = target[: a + 1]                  # [d1..da, b]
            n_emit = 0
            for t in ids:
                s.checker.push(t)
                n_emit += 1
                if s.checker.done:
                    break
            # a stop inside the round keeps only what was emitted: the last emitted token is pending
            keep = n_emit - 1
            commits.append((a, keep, n_emit, ids))
        if opt.rollback == "per_step":
            cache.rollback(out.gdn_steps, [keep + 1 for _, keep, _, _ in commits])
            how = ["per_step" if keep < k else "none" for _, keep, _, _ in commits]
        else:
            how = []
            for i, s in enumerate(seqs):
                keep = commits[i][1]
                if keep < k:
                    # restore the pre-round GDN state and re-decode s0, d1..d_keep; no logits and no hidden
                    # rows: the verification's rows h(P..P+keep) are the same values (spec §3.6)
                    cache.restore_gdn(s.slot, snaps[i])
                    cache.truncate(s.slot, P[i])
                    m.forward(rows[i:i + 1, : keep + 1], cache, [s.slot], logits="none", chunk=opt.delta_chunk)
                    how.append("redecode")
                else:
                    how.append("none")
        for i, s in enumerate(seqs):
            a, keep, n_emit, ids = commits[i]
            if self.uses_mtp:
                # commit E(P+j) = (d_j, h(P+j-1)) for j = 1..keep (spec §1.4), carry = h(P+keep); lazily,
                # the entries ride along with the next round's draft step 1
                if keep > 0 and opt.lazy_mtp_sync:
                    s.mtp_queue.extend(ids[:keep])
                    s.mtp_queue_hidden.append(h[i, :keep])
                elif keep > 0:
                    m.mtp_forward(d[i:i + 1, :keep], h[i:i + 1, :keep], cache, [s.slot], logits="none")
                s.carry = h[i, keep]
            s.n_past = P[i] + keep + 1
            s.pending = ids[n_emit - 1]
        t3 = self.opt.clock()
        timing = RoundTiming(t1 - t0, t2 - t1, t3 - t2, m.untimed_calls == u0)
        for i, (s, dec) in enumerate(group):
            a, keep, n_emit, _ = commits[i]
            s.decode_s += timing.round_s
            yield self._event(s, dec, k, a, n_emit, timing, how[i])

    def sync_mtp(self) -> None:
        """Write every queued MTP entry now (the cache then holds E(0..n-1) for each sequence)."""
        with torch.inference_mode():
            for s in self.seqs:
                self._flush_mtp(s)

    @staticmethod
    def _queue_hidden(s: _Seq, with_carry: bool = False, pad: int = 0) -> torch.Tensor:
        """The queued entries' hidden rows [n, E], then the carry's with_carry (pad + 1 times: padding rows)."""
        carry = s.carry[None] if pad == 0 else s.carry[None].expand(pad + 1, -1)
        blocks = s.mtp_queue_hidden + [carry] if with_carry else s.mtp_queue_hidden
        return blocks[0].contiguous() if len(blocks) == 1 else torch.cat(blocks)

    def _flush_mtp(self, s: _Seq) -> None:
        """Write the queued plain-step entries E(q) = (x_q, h(q-1)) in one MTP pass without the head."""
        if not s.mtp_queue:
            return
        x = torch.tensor([s.mtp_queue], dtype=torch.long, device=self.model.device)
        self.model.mtp_forward(x, self._queue_hidden(s)[None], self.cache, [s.slot], logits="none")
        s.mtp_queue.clear()
        s.mtp_queue_hidden.clear()

    def _event(self, s: _Seq, dec: Decision, k: int, a: int, emitted: int, timing: RoundTiming, how: str,
               plain_s: float | None = None) -> RoundEvent:
        c = s.controller
        if k == 0:
            c.observe_plain(plain_s)
        else:
            c.observe_round(k, a, timing)
        ev = RoundEvent(t=time.monotonic(), slot=s.slot, task=s.index, kind=dec.kind if k else "plain", k=k,
                        accepted=a, accepted_flags=tuple(j < a for j in range(k)), emitted=emitted,
                        round_s=timing.round_s, draft_s=timing.draft_s, verify_s=timing.verify_s,
                        rollback_s=timing.post_s, rollback=how, baseline_tps=c.baseline_tps,
                        pred_tps=dec.pred_tps, gate_state=c.state, gate_change=c.pop_change(),
                        n_past=s.n_past, n_generated=len(s.checker.tokens))
        s.stats.add(ev)
        return ev
