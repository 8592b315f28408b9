"""E11: prompt-prefix reuse on a slot never returns another prefix's state (real model, CPU float32)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from engine.scheduler.model_backend import ModelBackend
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.types import Assigned, GenerationRequest, TextDelta
from engine.spec.events import CALIBRATING
from engine.spec.policy import CALIBRATION_STEPS
from tests.conftest import fixture_path
from tests.engine.scheduler.scripted import CharText

N_GEN = 6


@pytest.fixture(scope="module")
def model():
    from engine.gguf import open_gguf
    from engine.model.model import load_model
    return load_model(open_gguf(fixture_path("models/tiny-qwen35-f32.gguf")))


def run(sched, prompt, checkpoint_at=(), mtp="on"):
    h = sched.submit(GenerationRequest(prompt=tuple(prompt), max_tokens=N_GEN, ignore_eos=True, mtp=mtp,
                                       checkpoint_at=tuple(checkpoint_at), slot=0))
    evs = list(h)
    assigned = next(e for e in evs if isinstance(e, Assigned))
    return assigned.cache_n, [t for e in evs if isinstance(e, TextDelta) for t in e.token_ids]


def next_logits(backend: ModelBackend, token: int) -> torch.Tensor:
    """Logits after feeding one more token to slot 0: a function of the whole cached state."""
    x = torch.tensor([[token]])
    with torch.inference_mode():
        return backend.model.forward(x, backend.cache, [0], logits="all").logits[0, 0]


def test_e11_prefix_pairs_match_fresh_slot(model):
    rng = random.Random(11)
    backend = ModelBackend(model, frozenset(), 1, 1024)
    sched = Scheduler(backend, CharText)
    pairs = hits = reprocessed = 0
    worst = 0.0
    try:
        cases = []
        for L in (0, 1, 15, 16, 17, 255, 256, 257):
            a = [rng.randrange(3399) for _ in range(L + 20)]
            b = a[:L] + [(a[L] + 1) % 3399] + [rng.randrange(3399) for _ in range(19)]
            cases.append((a, b, (L,), L))
        for m in (5, 40):  # same length, one token edited in the middle; boundaries every 16 tokens
            a = [rng.randrange(3399) for _ in range(64)]
            b = list(a)
            b[m] = (b[m] + 7) % 3399
            cases.append((a, b, tuple(range(16, 64, 16)), m // 16 * 16))
        for a, b, marks, expect_reuse in cases:
            for prompt, other in ((a, b), (b, a), (a, b)):   # order A, B, A on one slot
                run(sched, other, marks)
                cache_n, toks = run(sched, prompt, marks)
                fresh = ModelBackend(model, frozenset(), 1, 1024)
                fs = Scheduler(fresh, CharText)
                try:
                    fcache_n, ftoks = run(fs, prompt)  # other chunk shapes: one prefill
                finally:
                    fs.close()
                assert fcache_n == 0
                assert cache_n == expect_reuse, (len(prompt), cache_n, expect_reuse)
                assert backend.slots[0].tokens == fresh.slots[0].tokens
                assert toks == ftoks, (len(prompt), cache_n)
                d = (next_logits(backend, 7) - next_logits(fresh, 7)).abs().max().item()
                worst = max(worst, d)
                assert d <= 1e-4, (len(prompt), cache_n, d)
                pairs += 1
                hits += cache_n > 0
                reprocessed += cache_n == 0
                backend.abort(0)  # next_logits moved the cache past the request: start clean
    finally:
        sched.close()
    assert hits >= 12
    print(f"METRIC E11 pairs={pairs} mismatches=0 reuse_hits={hits} reprocessed={reprocessed} max_abs={worst:.2e}")


@pytest.mark.parametrize("lengths", [(5, 20, 40), (20,)])
@pytest.mark.parametrize("mode", ["on", "adaptive", "auto"])
def test_mtp_cache_matches_rewarm_after_batched_rounds(model, mode, lengths):
    """spec §1.5 on the batched backend: after plain steps and rounds of 3 slots decoded together (or one
    slot alone, whose accepted drafts ride along in the next draft step 1), each slot's MTP cache holds
    exactly E(0..n-1) and equals a fresh re-warm over its committed tokens."""
    from engine.model.cache import ModelCache
    from engine.model.mtp import shift_hidden
    rng = random.Random(5)
    backend = ModelBackend(model, frozenset(), 3, 512)
    sched = Scheduler(backend, CharText)
    try:
        hs = [sched.submit(GenerationRequest(prompt=tuple(rng.randrange(3399) for _ in range(n)), max_tokens=24,
                                             ignore_eos=True, mtp=mode, n_draft=3, slot=i))
              for i, n in enumerate(lengths)]
        stats = [list(h)[-1].spec for h in hs]
    finally:
        sched.close()
    assert sum(s["drafted"] for s in stats) > 0
    nb = model.cfg.nextn_blocks[0]
    for slot in range(len(lengths)):
        toks = backend.slots[slot].tokens
        n = len(toks)
        assert backend.cache.mtp_lengths[slot] == n == backend.cache.lengths[slot]
        fresh = ModelCache(model.cfg, 1, 512, mtp=True)
        x = torch.tensor([toks])
        with torch.inference_mode():
            out = model.forward(x, fresh, [0], logits="none")
            model.mtp_forward(x, shift_hidden(out.hidden), fresh, [0], logits="none")
        for got, ref in ((backend.cache.mtp_k[nb][slot, :n], fresh.mtp_k[nb][0, :n]),
                         (backend.cache.mtp_v[nb][slot, :n], fresh.mtp_v[nb][0, :n])):
            assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
        assert torch.allclose(backend.slots[slot].carry, out.hidden[0, -1], atol=1e-5, rtol=1e-4)


def test_stop_inside_a_round_leaves_only_committed_state(model):
    """A stop string that cuts a speculative round (spec §3.4): the slot keeps only prompt + kept tokens,
    and a follow-up request extending them continues exactly like a fresh slot (E11 after F3)."""
    rng = random.Random(3)
    prompt = tuple(rng.randrange(3399) for _ in range(24))
    backend = ModelBackend(model, frozenset(), 1, 512)
    sched = Scheduler(backend, CharText)
    try:
        full = [t for e in sched.submit(GenerationRequest(prompt=prompt, max_tokens=40, ignore_eos=True, mtp="on",
                                                          slot=0)) if isinstance(e, TextDelta) for t in e.token_ids]
        text = "".join(chr(97 + t % 26) for t in full)
        cut = 17
        stop = text[cut:cut + 2]
        evs = list(sched.submit(GenerationRequest(prompt=prompt, max_tokens=40, ignore_eos=True, mtp="on",
                                                  stop=(stop,), slot=0)))
        fin = evs[-1]
        kept = [t for e in evs if isinstance(e, TextDelta) for t in e.token_ids]
        assert fin.finish_reason == "stop" and kept == full[:fin.completion_tokens]
        assert list(backend.slots[0].tokens) == list(prompt) + kept[: len(backend.slots[0].tokens) - len(prompt)]
        assert len(backend.slots[0].tokens) <= len(prompt) + len(kept)
        follow = prompt + tuple(kept) + (11, 12, 13)
        cache_n, toks = run(sched, follow)
        fresh = ModelBackend(model, frozenset(), 1, 512)
        fs = Scheduler(fresh, CharText)
        try:
            _, ftoks = run(fs, follow)
        finally:
            fs.close()
        assert toks == ftoks and cache_n > 0
    finally:
        sched.close()


def test_auto_policy_is_kept_per_slot_across_requests(model):
    """`auto` learns acceptance and step costs once per slot (spec §4): the second request on a slot
    starts from what the first measured instead of the optimistic prior; other modes start fresh."""
    backend = ModelBackend(model, frozenset(), 2, 256)
    sched = Scheduler(backend, CharText)
    try:
        run(sched, [5, 6, 7, 8], mtp="auto")
        first = backend.slots[0].auto
        assert first is not None and first.t_plain is not None    # calibrated during the first request
        assert first.state != CALIBRATING and first.t_plain > 0
        seen = first.calibration_seen
        states = []
        decide = first.decide
        first.decide = lambda k_cap: (states.append(first.state), decide(k_cap))[1]
        run(sched, [9, 10, 11], mtp="auto")
        # the same estimates, never reset: the second request never calibrates again
        assert backend.slots[0].auto is first and first.t_plain is not None
        assert states and CALIBRATING not in states
        assert first.calibration_seen >= seen >= CALIBRATION_STEPS
        del first.decide
        assert backend.slots[1].auto is None                      # slot 1 never ran auto
        run(sched, [9, 10, 11], mtp="on")
        assert backend.slots[0].auto is first                     # kept for the slot's next auto request
    finally:
        sched.close()


def test_the_plain_steps_mtp_sync_is_timed_by_no_round_and_no_plain_step(model):
    """Plain steps queue their MTP entries (spec §5.3); the pass that writes a queue too long to ride along in
    a round's draft step 1 (here the seed gate's 4 baseline steps before a round of 2 drafts), or a full queue,
    is the sync of many steps. As in the one-sequence decoder it runs outside every timer the policies read:
    in the server a probe after a run of plain steps counted up to 255 rows of it as its drafting time."""
    for n_draft, queue_max in ((2, 256), (3, 3)):
        backend = ModelBackend(model, frozenset(), 1, 256)
        backend.mtp_queue_max = queue_max
        real_flush, real_event = backend._flush_mtp, backend._event
        log = []

        def slow_flush(slots, backend=backend, real_flush=real_flush, log=log):
            n = sum(len(backend.slots[s].mtp_queue_tokens) for s in slots)
            if n:
                log.append(("sync", n, 0.0))
                time.sleep(0.3)
            real_flush(slots)

        def event(slot, run, kind, k, a, emitted, timing, real_event=real_event, log=log):
            log.append((kind, k, timing.round_s))
            return real_event(slot, run, kind, k, a, emitted, timing)

        backend._flush_mtp, backend._event = slow_flush, event
        sched = Scheduler(backend, CharText)
        try:
            list(sched.submit(GenerationRequest(prompt=(5, 6, 7, 8, 9), max_tokens=12, ignore_eos=True,
                                                mtp="adaptive", n_draft=n_draft, slot=0)))
        finally:
            sched.close()
        steps = [(kind, n) for kind, n, _ in log]
        if queue_max == 256:      # 4 queued entries > 2 drafts: written before the round, apart
            assert steps[:6] == [("plain", 0)] * 4 + [("sync", 4), ("round", 2)], steps
        else:                     # a full queue at the third step (written before its event); the fourth's rides along
            assert steps[:6] == [("plain", 0)] * 2 + [("sync", 3)] + [("plain", 0)] * 2 + [("round", 3)], steps
        assert max(t for _, _, t in log) < 0.3, log
