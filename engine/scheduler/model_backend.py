"""The real slot backend: one Qwen3.5 model, one `ModelCache` for N slots, batched decode with MTP.

Each iteration (spec/mtp-speculation.md §6.1): prompt chunks for slots in prefill (cut at message
boundaries so checkpoints land there, §6.5), then for the decoding slots one batched main pass: plain
steps only (T = 1), or, when any slot drafts, one batched draft chain and one verification pass of
T = max k + 1 rows in which plain steps and shorter drafts are padded rows (§2, §3). MTP cache
alignment follows §1.3 (entry E(p) = (x_p, h(p-1)) at p; plain steps keep it in sync lazily, §5.3).
Greedy acceptance at temperature 0; sample-and-compare otherwise (§3.3). Never prints.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.model.cache import ModelCache
from engine.model.mtp import shift_hidden
from engine.scheduler.backend import SlotBackend, SlotStep
from engine.scheduler.prefix import Checkpoint, CheckpointStore, common_prefix, plan_reuse
from engine.scheduler.sampler import RequestSampler
from engine.scheduler.types import GenerationRequest
from engine.spec.events import CALIBRATING, DISABLED, RoundEvent
from engine.spec.gate import AdaptiveGate, DraftController, FixedPolicy, RoundTiming
from engine.spec.policy import AutoPolicy
from engine.spec.rejection import accepted_count, accepted_prefix


@dataclass
class _Run:
    """The request currently running on a slot."""

    task: int
    req: GenerationRequest
    controller: DraftController
    sampler: RequestSampler
    pos: int                               # prompt tokens in the cache
    checkpoint_at: frozenset[int]
    pending: int | None = None             # s0: sampled, emitted, not yet in the cache
    n_generated: int = 0
    last_k: int = 0
    kind: str = "plain"
    pred_tps: float = 0.0

    @property
    def uses_mtp(self) -> bool:
        return self.controller.uses_mtp


@dataclass
class _Slot:
    tokens: list[int] = field(default_factory=list)  # what the main cache holds (== cache.lengths[slot])
    live: bool = True                                 # GDN state corresponds to `tokens`
    carry: torch.Tensor | None = None                 # MTP hidden carry h(n-1) [E], post-norm
    # plain-step MTP entries not yet written (spec §5.3, lazy form): tokens x_q and their h(q-1)
    mtp_queue_tokens: list[int] = field(default_factory=list)
    mtp_queue_hidden: list[torch.Tensor] = field(default_factory=list)
    store: CheckpointStore | None = None
    # the slot's `auto` policy, kept across requests: acceptance and step costs learnt once, not per reply
    auto: AutoPolicy | None = None
    run: _Run | None = None
    reuse_source: str = "none"


class ModelBackend(SlotBackend):
    def __init__(self, model, eog_ids: frozenset[int], n_slots: int, n_ctx_slot: int, *, prefill_chunk: int = 256,
                 ctx_checkpoints: int = 8, delta_chunk: int = 64, kv_dtype: torch.dtype | None = None,
                 batch_slots: bool = True, pad_mixed: bool = True):
        self.model = model
        self.cfg = model.cfg
        self.n_slots = n_slots
        self.n_ctx_slot = n_ctx_slot
        self.n_vocab = self.cfg.n_vocab
        self.eog_ids = frozenset(eog_ids)
        self.prefill_chunk = prefill_chunk
        self.mtp_queue_max = 256   # spec §5.3: flush the lazy MTP queue at this many rows
        self.delta_chunk = delta_chunk
        self.has_mtp = self.cfg.has_mtp
        self.cache = ModelCache(self.cfg, n_slots, n_ctx_slot, device=model.device,
                                kv_dtype=kv_dtype or model.dtype, mtp=self.has_mtp)
        self.slots = [_Slot(store=CheckpointStore(ctx_checkpoints)) for _ in range(n_slots)]
        # False: every slot's step/round runs as its own forward (the "alternating" baseline of the
        # batching measurement); True: one forward per kind of work for all active slots
        self.batch_slots = batch_slots
        # True: slots taking a plain step or a shorter draft join the longest round's verification pass
        # as padded rows (one forward per iteration); False: one forward per kind of work
        self.pad_mixed = pad_mixed
        self.fault_hook = None   # test hook: fault_hook(slot, task) may raise before the slot's rows run
        self.output_hook = None  # test hook: output_hook(task, i, token) -> the token emitted as the i-th

    def compile_ahead(self, timeout_s: float) -> bool:
        """Compile the kind of call every request's plain steps are (one slot's decode step, at slot 0 and at
        the others) before the first request, waiting up to timeout_s: the compile's one-time cost (its
        imports, the first graph loaded: ~110 MiB on the f32 fixture) lands at start, not under load, and the
        first requests decode compiled. Runs on a scratch cache of the same layout, not the slots' own. True
        when nothing is left queued (or the steps are not compiled)."""
        steps = self.model._steps
        if steps is None:
            return True
        scratch = ModelCache(self.cfg, self.n_slots, 16, device=self.model.device, kv_dtype=self.cache.kv_dtype,
                             mtp=self.has_mtp)
        with torch.inference_mode():
            for slot in sorted({0, min(1, self.n_slots - 1)}):
                scratch.lengths[slot] = 2         # a decode step after a prompt: the kind's start class
                x = torch.ones(1, 1, dtype=torch.long, device=self.model.device)
                self.model.forward(x, scratch, [slot], logits="all", chunk=self.delta_chunk)
        return steps.drain(timeout_s)

    # ------------------------------------------------------------------ SlotBackend

    def cached_tokens(self, slot: int) -> Sequence[int]:
        return self.slots[slot].tokens

    def begin(self, slot: int, task: int, req: GenerationRequest, mtp: str, n_draft: int) -> int:
        st = self.slots[slot]
        controller = self._controller(mtp, n_draft, st)
        need_mtp = self.has_mtp and controller.uses_mtp
        live = st.live and (not need_mtp or (st.carry is not None and self.cache.mtp_lengths[slot] == len(st.tokens)))
        usable = [c for c in st.store.items if not need_mtp or c.carry is not None]
        plan = plan_reuse(st.tokens, live, usable, req.prompt)
        if plan.source == "checkpoint":
            self._restore(slot, plan.checkpoint)
        elif plan.source == "none":
            self._reset(slot)
        else:
            self._cut(slot, plan.n)
        st.store.drop_beyond(plan.n)
        st.reuse_source = plan.source
        if need_mtp and plan.n == 0:
            st.carry = None
        st.run = _Run(task=task, req=req, controller=controller, sampler=RequestSampler(req, self.n_vocab, self.model.device),
                      pos=plan.n, checkpoint_at=frozenset(c for c in req.checkpoint_at if 0 < c < len(req.prompt)))
        return plan.n

    def step(self, slots: Sequence[int], budgets: Sequence[int]) -> dict[int, SlotStep]:
        out: dict[int, SlotStep | Exception] = {}
        ready: list[tuple[int, int]] = []
        for slot, budget in zip(slots, budgets, strict=True):
            run = self.slots[slot].run
            if self.fault_hook is not None:
                try:
                    self.fault_hook(slot, run.task)
                except Exception as exc:
                    out[slot] = exc
                    continue
            if run.pending is None:
                out[slot] = self._prefill_chunk(slot)
            else:
                ready.append((slot, budget))
        with torch.inference_mode():
            plain: list[int] = []
            rounds: dict[int, list[int]] = {}
            for slot, budget in ready:
                k = self._choose_k(slot, budget)
                if k == 0:
                    plain.append(slot)
                else:
                    rounds.setdefault(k, []).append(slot)
            if not self.batch_slots:
                for slot in plain:
                    out.update(self._plain_steps([slot]))
                for k, group in sorted(rounds.items()):
                    for slot in group:
                        out.update(self._rounds([slot], [k]))
            elif rounds and self.pad_mixed:
                # one pass for every ready slot: plain steps and shorter drafts ride as padded rows
                group = plain + [s for k in sorted(rounds) for s in rounds[k]]
                ks = [0] * len(plain) + [k for k in sorted(rounds) for _ in rounds[k]]
                out.update(self._rounds(group, ks))
            else:
                if plain:
                    out.update(self._plain_steps(plain))
                for k, group in sorted(rounds.items()):
                    out.update(self._rounds(group, [k] * len(group)))
        return out

    def finish(self, slot: int, n_kept: int) -> None:
        st = self.slots[slot]
        run = st.run
        if run is None:
            return
        with torch.inference_mode():
            self._flush_mtp([slot])
        st.run = None
        want = list(run.req.prompt) + self._generated(run, st)[:n_kept]
        held = st.tokens
        if not (held == want or held == want[:-1]):
            n = common_prefix(held, want)
            self._cut(slot, n)
            st.live = False
        if st.live:
            self._checkpoint(slot)

    def abort(self, slot: int) -> None:
        """Cancelled or failed: a cancel lands between iterations, where the cache is consistent, but a
        failure may have left a forward half done; either way nothing is kept (E9, E11)."""
        st = self.slots[slot]
        st.run = None
        self._reset(slot)
        st.store.clear()

    def slot_info(self, slot: int) -> dict:
        st = self.slots[slot]
        run = st.run
        info = {"n_past": len(st.tokens), "n_checkpoints": len(st.store.items),
                "checkpoint_bytes": st.store.nbytes, "reuse": st.reuse_source}
        if run is None:
            return {**info, "speculative": False}
        c = run.controller
        gate = c.state
        info.update({
            "speculative": self.has_mtp and c.uses_mtp and gate != DISABLED,
            "policy": {"on": "fixed", "off": "fixed"}.get(c.name, c.name), "k": run.last_k,
            "gate_state": gate, "gate_reason": getattr(c, "disable_detail", None) and c.disable_detail["reason"],
            "accept_ema": getattr(c, "accept", None), "mtp_tps_ema": getattr(c, "mtp_tps", None),
            "no_mtp_tps_ema": c.baseline_tps,
        })
        return info

    # ------------------------------------------------------------------ state helpers

    def _generated(self, run: _Run, st: _Slot) -> list[int]:
        """Generated tokens of the run: those in the cache past the prompt, then the pending one."""
        gen = st.tokens[len(run.req.prompt):]
        return gen + ([run.pending] if run.pending is not None else [])

    def _controller(self, mtp: str, n_draft: int, st: _Slot | None = None) -> DraftController:
        if not self.has_mtp or mtp == "off" or n_draft == 0:
            return FixedPolicy(0)
        if mtp == "on":
            return FixedPolicy(n_draft)
        if mtp == "adaptive":
            return AdaptiveGate(n_draft)      # the seed's gate decides per request
        k_max = max(n_draft, 1)
        if st is None:
            return AutoPolicy(k_max=k_max)
        if st.auto is None or st.auto.k_max != k_max:
            st.auto = AutoPolicy(k_max=k_max)
        else:
            st.auto.new_request()
        return st.auto

    def _reset(self, slot: int) -> None:
        st = self.slots[slot]
        self.cache.reset(slot)
        st.tokens, st.live, st.carry = [], True, None
        st.mtp_queue_tokens, st.mtp_queue_hidden = [], []

    def _cut(self, slot: int, n: int) -> None:
        """Keep the first n tokens of KV (main and MTP); the GDN state is not touched."""
        st = self.slots[slot]
        st.mtp_queue_tokens, st.mtp_queue_hidden = [], []   # never written: the MTP cache stays shorter
        self.cache.truncate(slot, n)
        if self.has_mtp:
            self.cache.truncate_mtp(slot, min(n, self.cache.mtp_lengths[slot]))
        del st.tokens[n:]

    def _restore(self, slot: int, ck: Checkpoint) -> None:
        st = self.slots[slot]
        self._cut(slot, ck.n)
        self.cache.restore_gdn(slot, ck.gdn)
        st.carry = None if ck.carry is None else ck.carry.clone()
        st.live = True

    def _flush_mtp(self, slots: Sequence[int]) -> None:
        """Write the queued plain-step MTP entries E(q) = (x_q, h(q-1)) of these slots: one head-less
        MTP pass per slot (spec §5.3 lazy form), before a draft, a checkpoint or the end of a request."""
        for s in slots:
            st = self.slots[s]
            if not st.mtp_queue_tokens:
                continue
            x = torch.tensor([st.mtp_queue_tokens], dtype=torch.long, device=self.model.device)
            hid = torch.stack(st.mtp_queue_hidden)[None]
            self.model.mtp_forward(x, hid, self.cache, [s], logits="none")
            st.mtp_queue_tokens, st.mtp_queue_hidden = [], []

    def _checkpoint(self, slot: int) -> None:
        st = self.slots[slot]
        with torch.inference_mode():
            self._flush_mtp([slot])
        n = len(st.tokens)
        if n == 0 or not st.live:
            return
        # the carry is stored only where the MTP cache holds exactly E(0..n-1): only such checkpoints can
        # resume a request with MTP on
        aligned = self.has_mtp and st.carry is not None and self.cache.mtp_lengths[slot] == n
        carry = st.carry.clone() if aligned else None
        st.store.add(Checkpoint(n, self.cache.snapshot_gdn(slot), carry))

    # ------------------------------------------------------------------ prefill

    def _prefill_chunk(self, slot: int) -> SlotStep:
        st = self.slots[slot]
        run = st.run
        prompt = run.req.prompt
        end = min(len(prompt), run.pos + self.prefill_chunk)
        nxt = [c for c in run.checkpoint_at if run.pos < c < end]
        if nxt:
            end = min(nxt)
        last = end == len(prompt)
        with torch.inference_mode():   # x too: a compiled step's guards tell inference tensors from others
            x = torch.tensor([prompt[run.pos:end]], dtype=torch.long, device=self.model.device)
            out = self.model.forward(x, self.cache, [slot], logits="last" if last else "none", chunk=self.delta_chunk)
            if self.has_mtp and run.uses_mtp:
                prev = None if st.carry is None else st.carry[None]
                self.model.mtp_forward(x, shift_hidden(out.hidden, prev), self.cache, [slot], logits="none")
                st.carry = out.hidden[0, -1].clone()
        st.tokens.extend(prompt[run.pos:end])
        res = SlotStep(prompt_processed=end - run.pos)
        run.pos = end
        if end in run.checkpoint_at or last:
            self._checkpoint(slot)
        if last:
            tok = run.sampler.sample_rows(out.logits[0, -1:])[0]
            self._emit(run, res, [tok])
        return res

    # ------------------------------------------------------------------ decode

    def _choose_k(self, slot: int, budget: int) -> int:
        st = self.slots[slot]
        run = st.run
        n_past = len(st.tokens)
        k_cap = max(0, min(budget - 1, self.n_ctx_slot - n_past - 2))
        if not self.has_mtp:
            k_cap = 0
        dec = run.controller.decide(k_cap)
        run.last_k = dec.k
        run.kind = dec.kind
        run.pred_tps = dec.pred_tps
        return dec.k

    def _emit(self, run: _Run, res: SlotStep, toks: list[int]) -> None:
        """Commit sampled tokens to the output, stopping at an end-of-generation token."""
        if self.output_hook is not None:
            toks = [self.output_hook(run.task, run.n_generated + j, t) for j, t in enumerate(toks)]
        for t in toks:
            res.tokens.append(t)
            run.n_generated += 1
            if t in self.eog_ids and not run.req.ignore_eos:
                res.eos = True
                break
        run.sampler.accept(res.tokens)
        run.pending = toks[-1]

    def _plain_steps(self, slots: list[int]) -> dict[int, SlotStep]:
        t0 = time.perf_counter()
        u0 = self.model.untimed_calls       # RoundTiming.timed
        dev = self.model.device
        x = torch.tensor([[self.slots[s].run.pending] for s in slots], dtype=torch.long, device=dev)
        out = self.model.forward(x, self.cache, slots, logits="all", chunk=self.delta_chunk)
        sync = [i for i, s in enumerate(slots) if self.has_mtp and self.slots[s].run.uses_mtp]
        for i in sync:  # spec §5.3: plain steps keep the MTP cache in sync, lazily
            st = self.slots[slots[i]]
            st.mtp_queue_tokens.append(st.run.pending)
            st.mtp_queue_hidden.append(st.carry)
        full = [slots[i] for i in sync if len(self.slots[slots[i]].mtp_queue_tokens) >= self.mtp_queue_max]
        greedy = None
        if all(self.slots[s].run.sampler.plain_greedy for s in slots):
            greedy = out.logits[:, 0].argmax(dim=-1).tolist()   # one host read for the batch
        results = {}
        for i, s in enumerate(slots):
            st = self.slots[s]
            run = st.run
            st.tokens.append(run.pending)
            if i in sync:
                st.carry = out.hidden[i, 0].clone()
            tok = greedy[i] if greedy is not None else run.sampler.sample_rows(out.logits[i, :1])[0]
            res = SlotStep()
            self._emit(run, res, [tok])
            results[s] = res
        dt = time.perf_counter() - t0
        timed = self.model.untimed_calls == u0
        # a full queue is written after the step's timer: it is the sync of many steps, not this step's cost
        self._flush_mtp(full)
        for s in slots:
            run = self.slots[s].run
            if self.has_mtp and run.uses_mtp:
                run.controller.observe_plain(dt if timed else 0.0)
                results[s].events.append(self._event(s, run, "plain", 0, 0, 1, RoundTiming(0.0, dt, 0.0)))
        return results

    def _rounds(self, slots: list[int], ks: list[int]) -> dict[int, SlotStep]:
        """One verification pass for all `slots`, batched (spec §2, §3): slot i drafts ks[i] tokens, 0 being
        a plain step carried in the same pass. Rows past a slot's own k+1 are padding and are rolled back
        with the rejected drafts (KV by length, GDN state by the per-step snapshots)."""
        dev = self.model.device
        B, K = len(slots), max(ks)
        spec = [i for i in range(B) if ks[i] > 0]
        spec_slots = [slots[i] for i in spec]
        # where every drafting slot drafts K, their queued MTP entries (the last round's accepted drafts, plain
        # steps) ride along in draft step 1 when they fit it (one slot: `Qwen35Model.step1_queue_max`, K or its
        # padded length; several: K). A longer queue (or any, where the slots draft different counts) is written
        # first, outside the round's timer: that is the plain steps' MTP sync (a probe after a run of plain steps
        # writes up to 255 of them), not a cost of drafting that policies should see
        one_k = all(ks[i] == K for i in spec)
        q_max = (self.model.step1_queue_max(K) if len(spec) == 1 else K) if one_k else 0
        self._flush_mtp([s for s in spec_slots if len(self.slots[s].mtp_queue_tokens) > q_max])
        t0 = time.perf_counter()
        u0 = self.model.untimed_calls       # RoundTiming.timed
        s0_host = [self.slots[s].run.pending for s in slots]
        s0 = torch.tensor([[t] for t in s0_host], dtype=torch.long, device=dev)
        P = [len(self.slots[s].tokens) for s in slots]
        d = torch.zeros(B, K, dtype=torch.long, device=dev)           # drafts; padding past a slot's k
        samplers = [self.slots[s].run.sampler for s in slots]
        # every slot drafts K: drafting and verification in one call (one compiled graph), whose time counts as
        # verification; drafts are greedy whatever the sampling, and sampled slots draw from its logits (§3.3)
        fused = len(spec) == B and all(k == K for k in ks) and self.model.steps_status[0] == "compiled"
        targets = out = None
        if spec and one_k:
            # every drafting slot drafts K: the whole chain in one call (one compiled graph)
            # each slot's queued entries and its pending token, padded to one step-1 length per K (one compiled
            # graph; `Qwen35Model.step1_pad`, several slots `step1_pads`): the padding rows (the pending token
            # and its carry) go before the pending row
            sts = [self.slots[s] for s in spec_slots]
            ts = [len(st.mtp_queue_tokens) + 1 for st in sts]
            pads = [self.model.step1_pad(self.cache, spec_slots[0], ts[0], K)] if len(spec) == 1 else \
                self.model.step1_pads(self.cache, spec_slots, ts, K)
            if pads is None:                # rows past the cache's end: step 1 is the pending tokens alone
                self._flush_mtp(spec_slots)
                pads = [0] * len(spec)
            x = torch.tensor([[*st.mtp_queue_tokens, *[s0_host[i]] * (p + 1)]
                              for st, i, p in zip(sts, spec, pads, strict=True)], dtype=torch.long, device=dev)
            hid = torch.stack([torch.stack([*st.mtp_queue_hidden, *[st.carry] * (p + 1)])
                               for st, p in zip(sts, pads, strict=True)])
            for st in sts:
                st.mtp_queue_tokens, st.mtp_queue_hidden = [], []
            pad = pads[0] if len(spec) == 1 else pads
            if fused:
                d, out, targets = self.model.draft_and_verify(x, hid, self.cache, slots, K, chunk=self.delta_chunk,
                                                              pad=pad)
            else:
                d[spec], _ = self.model.draft_chain(x, hid, self.cache, spec_slots, K, pad=pad)
            for i in spec:
                self.cache.truncate_mtp(slots[i], P[i] + 1)  # keep E(P) of step 1, drop the chain's scratch
        elif spec:
            tok = s0[spec]                                            # [S, 1]
            hid = torch.stack([self.slots[s].carry for s in spec_slots])[:, None]
            for j in range(K):
                act = [n for n, i in enumerate(spec) if ks[i] > j]
                if len(act) == len(spec):
                    m = self.model.mtp_forward(tok, hid, self.cache, spec_slots, logits="last")
                    tok = m.logits[:, -1].argmax(dim=-1, keepdim=True)
                    hid = m.hidden
                else:
                    m = self.model.mtp_forward(tok[act], hid[act], self.cache, [spec_slots[n] for n in act],
                                               logits="last")
                    tok, hid = tok.clone(), hid.clone()
                    tok[act] = m.logits[:, -1].argmax(dim=-1, keepdim=True)
                    hid[act] = m.hidden
                d[[spec[n] for n in act], j] = tok[act, 0]
            for i in spec:
                self.cache.truncate_mtp(slots[i], P[i] + 1)  # keep E(P) of step 1, drop the chain's scratch
        for i in range(B):
            st = self.slots[slots[i]]
            if ks[i] == 0 and self.has_mtp and st.run.uses_mtp:   # a plain step: E(P) queued (§5.3)
                st.mtp_queue_tokens.append(s0_host[i])
                st.mtp_queue_hidden.append(st.carry)
        t1 = t0 if fused else time.perf_counter()
        if not fused:
            rows = torch.cat([s0, d], dim=1)                           # [B, K+1]
            out = self.model.forward(rows, self.cache, slots, logits="all", chunk=self.delta_chunk, gdn_steps=True)
        if all(sm.plain_greedy for sm in samplers):
            # spec §3.2 for every slot at once: one argmax and one host read for the whole batch
            if targets is None:
                targets = out.logits.argmax(dim=-1)
            both = torch.cat([d, targets], dim=1).tolist()             # [B, K + (K+1)]
            d_host = [r[:K] for r in both]
            emitted = []
            for i, r in enumerate(both):
                dr, tg = r[:K], r[K:]
                a = accepted_count(dr, tg, ks[i])
                emitted.append(dr[:a] + [tg[a]])
        else:
            d_host = d.tolist()
            emitted = [sm.verify(out.logits[i, :ks[i] + 1], d_host[i][:ks[i]], accepted_prefix)
                       for i, sm in enumerate(samplers)]
        n_acc = [len(ids) - 1 for ids in emitted]
        t2 = time.perf_counter()
        self.cache.rollback(out.gdn_steps, [a + 1 for a in n_acc])
        # spec §1.3 accept: E(P+j) = (d_j, h(P+j-1)) for j = 1..a, queued per drafting slot (§5.3 lazily): the
        # next round's draft step 1 writes them, or a flush before a checkpoint
        for i in spec:
            if n_acc[i] > 0:
                st = self.slots[slots[i]]
                st.mtp_queue_tokens.extend(d_host[i][:n_acc[i]])
                st.mtp_queue_hidden.extend(out.hidden[i, :n_acc[i]])
        results = {}
        for i, s in enumerate(slots):
            st = self.slots[s]
            a = n_acc[i]
            st.tokens.extend([s0_host[i], *d_host[i][:a]])
            if self.has_mtp and st.run.uses_mtp:
                st.carry = out.hidden[i, a].clone()
            res = SlotStep()
            self._emit(st.run, res, emitted[i])
            results[s] = res
        t3 = time.perf_counter()
        # wall time of the whole batched pass, as a plain step's is of the whole batched step: each slot
        # waits for all rows of its batch (spec §5.1: timings include the other slots' rows)
        timing = RoundTiming(t1 - t0, t2 - t1, t3 - t2, self.model.untimed_calls == u0)
        for i, s in enumerate(slots):
            run = self.slots[s].run
            if ks[i] == 0:
                if self.has_mtp and run.uses_mtp:
                    run.controller.observe_plain(timing.round_s if timing.timed else 0.0)
                    results[s].events.append(self._event(s, run, "plain", 0, 0, len(results[s].tokens),
                                                         RoundTiming(0.0, timing.round_s, 0.0)))
                continue
            run.controller.observe_round(ks[i], n_acc[i], timing)
            results[s].events.append(self._event(s, run, run.kind, ks[i], n_acc[i], len(results[s].tokens),
                                                 timing))
        return results

    def _event(self, slot: int, run: _Run, kind: str, k: int, a: int, emitted: int, timing: RoundTiming
               ) -> RoundEvent:
        c = run.controller
        change = c.pop_change()
        return RoundEvent(t=time.monotonic(), slot=slot, task=run.task, kind=kind, k=k, accepted=a,
                          accepted_flags=tuple(j < a for j in range(k)), emitted=emitted, round_s=timing.round_s,
                          draft_s=timing.draft_s, verify_s=timing.verify_s, rollback_s=timing.post_s,
                          rollback="per_step" if k and a < k else "none", baseline_tps=c.baseline_tps,
                          pred_tps=run.pred_tps, gate_state=c.state, gate_change=change,
                          n_past=len(self.slots[slot].tokens), n_generated=run.n_generated)


__all__ = ["ModelBackend", "CALIBRATING"]
