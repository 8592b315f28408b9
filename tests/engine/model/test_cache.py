"""Cache equivalences: chunked prefill == one shot, prefill + step decode == full recompute,
N slots together == each alone, reset == fresh, and speculative rollback (STYLE.md §3)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import codegen
from engine.model import ModelCache, shift_hidden
from engine.model.attention import GatedAttention
from tests.engine.model.conftest import F32_MODELS, assert_close, get_model, get_ref

TIGHT = {"atol": 2e-5, "rtol": 2e-5}   # same math, different batching / chunking


@pytest.fixture(params=sorted(F32_MODELS))
def model(request):
    return get_model(F32_MODELS[request.param][0])


def _text(n: int, offset: int = 0) -> torch.Tensor:
    return torch.tensor(get_ref(F32_MODELS["dense"][1])["ppl_tokens"][offset:offset + n], dtype=torch.long)[None]


@pytest.mark.parametrize("chunk_tokens", [1, 7, 200])
def test_chunked_prefill_equals_one_shot(model, chunk_tokens):
    tokens = _text(70)
    ref = model(tokens)
    cache = ModelCache(model.cfg, 1, 128)
    out = model.prefill(tokens, cache, chunk_tokens=chunk_tokens, logits="all")
    assert cache.lengths == [70]
    assert_close(out.logits.numpy(), ref.logits.numpy(), "logits", **TIGHT)
    assert_close(out.hidden.numpy(), ref.hidden.numpy(), "hidden", **TIGHT)


@pytest.mark.parametrize("delta_chunk", [1, 7, 64])
def test_delta_rule_chunk_length_does_not_change_logits(model, delta_chunk):
    tokens = _text(70, 500)
    ref = model(tokens, chunk=64)
    out = model(tokens, chunk=delta_chunk)
    assert_close(out.logits.numpy(), ref.logits.numpy(), "logits", **TIGHT)


def test_prefill_then_decode_equals_full_recompute(model):
    tokens = _text(40, 1000)
    full = model(tokens)
    cache = ModelCache(model.cfg, 1, 64)
    steps = [model(tokens[:, :25], cache).logits]
    for t in range(25, 40):
        steps.append(model(tokens[:, t:t + 1], cache).logits)
    assert_close(torch.cat(steps, dim=1).numpy(), full.logits.numpy(), "logits", **TIGHT)


def test_slots_together_equal_each_alone(model):
    """Three sequences at different lengths decoded in one batch, rows in shuffled slot order."""
    prompts = [_text(n, off) for n, off in ((5, 0), (12, 300), (30, 900))]
    conts = [_text(6, off) for off in (50, 400, 1200)]
    alone = []
    for p, c in zip(prompts, conts, strict=True):
        cache = ModelCache(model.cfg, 1, 64)
        model(p, cache, logits="none")
        alone.append(torch.cat([model(c[:, i:i + 1], cache).logits for i in range(6)], dim=1))
    cache = ModelCache(model.cfg, 4, 64)
    for slot, p in zip((2, 0, 3), prompts, strict=True):   # slot 1 stays unused
        model(p, cache, [slot], logits="none")
    order = [3, 2, 0]                                       # row r -> slot order[r] -> sequence seq[r]
    seq = [2, 0, 1]
    got = []
    for i in range(6):
        toks = torch.cat([conts[s][:, i:i + 1] for s in seq], dim=0)
        got.append(model(toks, cache, order).logits)
    got = torch.cat(got, dim=1)
    for r, s in enumerate(seq):
        assert_close(got[r].numpy(), alone[s][0].numpy(), f"sequence {s}", **TIGHT)
    assert cache.lengths == [18, 0, 11, 36]


def test_reset_equals_fresh(model):
    tokens = _text(20, 2000)
    fresh = model(tokens, ModelCache(model.cfg, 2, 64), [1]).logits
    cache = ModelCache(model.cfg, 2, 64)
    model(_text(33, 100), cache, [1])
    model(_text(9, 200), cache, [1])
    model(_text(33, 100), cache, [0])
    cache.reset(1)
    assert cache.lengths == [33, 0]
    assert torch.equal(model(tokens, cache, [1]).logits, fresh)


def test_rollback_after_verification_equals_plain_decoding(model):
    """A verify-style forward of 4 tokens with per-step GDN states, rolled back to 2 accepted
    tokens, leaves the same KV length and GDN state as decoding just those 2 (within 1e-5 rel)."""
    prompt, draft = _text(17, 3000), _text(4, 3100)
    plain = ModelCache(model.cfg, 1, 64)
    model(prompt, plain, logits="none")
    plain_logits = [model(draft[:, i:i + 1], plain).logits for i in range(2)]
    cache = ModelCache(model.cfg, 2, 64)
    model(prompt, cache, [1], logits="none")
    out = model(draft, cache, [1], gdn_steps=True)
    assert out.gdn_steps.conv[0].shape[:2] == (1, 3)     # the states inside the call: after 1, 2, 3 tokens
    assert_close(out.logits[:, :2].numpy(), torch.cat(plain_logits, 1).numpy(), "verify logits", **TIGHT)
    cache.rollback(out.gdn_steps, [2])
    assert cache.lengths == [0, 19]
    for b in model.cfg.gdn_layers:
        for got, ref in ((cache.conv[b][1], plain.conv[b][0]), (cache.ssm[b][1], plain.ssm[b][0])):
            assert ((got - ref).abs().max() / ref.abs().max()) <= 1e-5
    nxt = _text(1, 3200)
    assert_close(model(nxt, cache, [1]).logits.numpy(), model(nxt, plain).logits.numpy(), "after", **TIGHT)


def test_rollback_keeping_every_token_or_none(model):
    """Keeping all T tokens leaves the cache as the forward left it (the final state is already there);
    keeping none is refused before anything changes: the state before the call is not among the steps."""
    prompt, draft = _text(11, 3300), _text(3, 3400)
    cache = ModelCache(model.cfg, 1, 32)
    model(prompt, cache, logits="none")
    out = model(draft, cache, gdn_steps=True)
    after = cache.snapshot_gdn(0)
    with pytest.raises(ValueError, match="n_keep 0 not in 1..3"):
        cache.rollback(out.gdn_steps, [0])
    with pytest.raises(ValueError, match="2 counts for 1 rows"):
        cache.rollback(out.gdn_steps, [3, 3])
    cache.rollback(out.gdn_steps, [3])
    assert cache.lengths == [14]
    for b in model.cfg.gdn_layers:
        assert torch.equal(cache.conv[b][0], after.conv[b]) and torch.equal(cache.ssm[b][0], after.ssm[b])


def test_snapshot_restore_and_truncate(model):
    prompt, extra = _text(10, 4000), _text(5, 4100)
    cache = ModelCache(model.cfg, 1, 64)
    model(prompt, cache, logits="none")
    snap = cache.snapshot_gdn(0)
    ref = model(_text(1, 4200), ModelCache(model.cfg, 1, 64), logits="none")  # unrelated call
    del ref
    model(extra, cache, logits="none")
    cache.restore_gdn(0, snap)
    cache.truncate(0, 10)
    probe = _text(3, 4300)
    again = model(probe, cache).logits
    fresh = ModelCache(model.cfg, 1, 64)
    model(prompt, fresh, logits="none")
    assert_close(again.numpy(), model(probe, fresh).logits.numpy(), "after restore", **TIGHT)


def test_mtp_cache_truncate_and_draft_chain(model):
    """Drafting one row at a time after a prompt warm-up, then truncating the MTP cache, repeats."""
    tokens = _text(12, 5000)
    cache = ModelCache(model.cfg, 1, 64)
    out = model(tokens, cache, logits="none")
    model.mtp_forward(tokens, shift_hidden(out.hidden), cache, logits="none")
    nxt = _text(1, 5012)
    d1 = model.mtp_forward(nxt, out.hidden[:, -1:], cache)
    d2 = model.mtp_forward(d1.logits.argmax(-1), d1.hidden, cache)
    assert cache.mtp_lengths == [14]
    cache.truncate_mtp(0, 12)
    e1 = model.mtp_forward(nxt, out.hidden[:, -1:], cache)
    e2 = model.mtp_forward(e1.logits.argmax(-1), e1.hidden, cache)
    assert torch.equal(d1.logits, e1.logits) and torch.equal(d2.logits, e2.logits)


def test_mtp_cache_commit_computes_only_keys_and_values(model):
    """A cache commit (`mtp_forward(..., cache, logits='none')`: prompt warm-up, plain-step sync, accepted
    drafts) writes the rows the whole block writes, for one slot and for two, without running the block's
    attention output, FFN or head (the seed's no-logits update, taken to what the cache keeps)."""
    n_mtp = model.cfg.nextn_blocks[0]
    blk = model.blk[n_mtp]
    calls = []
    hooks = [mod.register_forward_hook(lambda *a, name=name: calls.append(name))
             for name, mod in (("ffn", blk.ffn), ("attn_q", blk.mixer.attn_q), ("attn_output", blk.mixer.attn_output))]
    try:
        for slots in ([1], [0, 1]):
            tokens = torch.cat([_text(11, 5000 + 30 * s) for s in slots])
            hidden = shift_hidden(model(tokens, ModelCache(model.cfg, 2, 32), slots, logits="none").hidden)
            commit, whole = ModelCache(model.cfg, 2, 32), ModelCache(model.cfg, 2, 32)
            calls.clear()
            out = model.mtp_forward(tokens, hidden, commit, slots, logits="none")
            assert out.hidden is None and out.logits is None and calls == []
            model.mtp_forward(tokens, hidden, whole, slots, logits="all")
            assert calls                                   # the whole block ran here
            assert commit.mtp_lengths == whole.mtp_lengths
            for s in slots:
                assert torch.equal(commit.mtp_k[n_mtp][s, :11], whole.mtp_k[n_mtp][s, :11])
                assert torch.equal(commit.mtp_v[n_mtp][s, :11], whole.mtp_v[n_mtp][s, :11])
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("queued", [0, 3])
def test_draft_chain_equals_step_by_step_drafting(model, queued, monkeypatch):
    """`draft_chain` (one call, one compiled graph when enabled) drafts what k single MTP steps draft,
    with queued entries riding along in step 1, for two slots at different lengths (so steps 2..k
    mask each slot's own cache end); the MTP cache then holds step 1's rows, the same as the single
    steps wrote, in one store (a second store into a buffer made a compiled graph copy all of it), and
    steps 2..k wrote nothing (their rows are scratch)."""
    k = 3
    caches = [ModelCache(model.cfg, 2, 64) for _ in range(2)]
    hid = {}
    for c in caches:
        for s, n in ((0, 9), (1, 13)):
            t = _text(n, 5000 + 40 * s)
            out = model(t, c, [s], logits="none")
            model.mtp_forward(t[:, :n - queued], shift_hidden(out.hidden)[:, :n - queued], c, [s], logits="none")
            hid[s] = (t, shift_hidden(out.hidden))
    rows = torch.cat([hid[s][0][:, hid[s][0].shape[1] - queued - 1:] for s in (0, 1)])[:, :queued + 1]
    rows_h = torch.cat([hid[s][1][:, hid[s][1].shape[1] - queued - 1:] for s in (0, 1)])[:, :queued + 1]
    want = []
    one = caches[0]
    mo = model.mtp_forward(rows, rows_h, one, [0, 1], logits="last")
    tok, h = mo.logits[:, -1:].argmax(-1), mo.hidden[:, -1:]
    want.append(tok)
    for _ in range(k - 1):
        mo = model.mtp_forward(tok, h, one, [0, 1], logits="last")
        tok, h = mo.logits[:, -1:].argmax(-1), mo.hidden
        want.append(tok)
    stores = []
    store = GatedAttention._store
    monkeypatch.setattr(GatedAttention, "_store", staticmethod(lambda kk, vv, kv: (stores.append(kk.shape[1]),
                                                                                    store(kk, vv, kv))))
    got, last = model.draft_chain(rows, rows_h, caches[1], [0, 1], k)
    assert stores == [queued + 1]
    assert torch.equal(got, torch.cat(want, dim=1)) and got.shape == (2, k)
    assert torch.allclose(last, h, **TIGHT)
    assert caches[1].mtp_lengths == [n - (k - 1) for n in one.mtp_lengths]
    n_mtp = model.cfg.nextn_blocks[0]
    for s, n in enumerate(caches[1].mtp_lengths):
        assert torch.allclose(caches[1].mtp_k[n_mtp][s, :n], one.mtp_k[n_mtp][s, :n], **TIGHT)
        assert torch.allclose(caches[1].mtp_v[n_mtp][s, :n], one.mtp_v[n_mtp][s, :n], **TIGHT)
        assert not caches[1].mtp_k[n_mtp][s, n:].any()      # nothing written past step 1


@pytest.mark.parametrize("fused", [False, True])
def test_a_padded_step_one_drafts_and_keeps_what_the_unpadded_one_does(model, fused):
    """One sequence's draft step 1 padded to a fixed length (`step1_pad`: one compiled graph per k instead of
    one per count of queued entries): padding rows just before the pending row, written after its position,
    change neither the drafts, the verification nor the MTP cache's rows up to it, and the next round, which
    writes over them, drafts the same. The rows are stored in one store (see `Qwen35Model._mtp`)."""
    k, n = 3, 6
    n_mtp = model.cfg.nextn_blocks[0]
    for queued in range(k + 1):
        T, pad = queued + 1, n - queued - 1
        t = _text(20, 700 + 10 * queued)
        runs = []
        for p in (0, pad):
            cache, h = _prompt_cache(model, t[:, :20 - queued])
            cache.truncate_mtp(0, cache.mtp_lengths[0] - queued)       # the last `queued` entries still queued
            # padding rows of any content (the decoder pads with the pending row's)
            g = torch.Generator().manual_seed(queued)
            hh = torch.cat([h[:, -T:], torch.randn(1, p, h.shape[-1], generator=g)], dim=1)
            rows = torch.cat([t[:, 20 - queued - T:20 - queued], torch.randint(0, 100, (1, p), generator=g)], dim=1)
            # the padding rows go before the pending row (the last): rows [queued..., pad..., pending]
            rows = torch.cat([rows[:, :T - 1], rows[:, T:], rows[:, T - 1:T]], dim=1)
            hh = torch.cat([hh[:, :T - 1], hh[:, T:], hh[:, T - 1:T]], dim=1)
            P = cache.mtp_lengths[0] + T - 1
            if fused:
                d, out, target = model.draft_and_verify(rows, hh, cache, [0], k, pad=p)
            else:
                d, last = model.draft_chain(rows, hh, cache, [0], k, pad=p)
                out, target = None, last
            assert cache.mtp_lengths[0] == P + 1
            lengths = cache.lengths[0]
            # the next round: the pending token's hidden row after a rejected round, step 1 of one row
            cache.truncate(0, P + 1)
            cache.truncate_mtp(0, P + 1)
            h2 = out.hidden[:, :1] if fused else h[:, -1:]
            d2, last2 = model.draft_chain(d[:, :1], h2, cache, [0], k)
            runs.append((d, out, target, d2, last2, cache, lengths))
        (d, out, target, d2, h2, c0, n0), (pd, pout, ptarget, pd2, ph2, c1, n1) = runs
        assert torch.equal(d, pd) and torch.equal(d2, pd2) and n0 == n1, queued
        assert torch.allclose(h2, ph2, **TIGHT)
        if fused:
            assert torch.equal(target, ptarget) and torch.allclose(out.logits, pout.logits, **TIGHT)
        else:
            assert torch.allclose(target, ptarget, **TIGHT)        # the chain's last MTP hidden row
        L = c0.mtp_lengths[0]
        assert c1.mtp_lengths[0] == L
        assert torch.allclose(c1.mtp_k[n_mtp][0, :L], c0.mtp_k[n_mtp][0, :L], **TIGHT)
        assert torch.allclose(c1.mtp_v[n_mtp][0, :L], c0.mtp_v[n_mtp][0, :L], **TIGHT)
    with pytest.raises(ValueError, match="padding rows"):
        model.draft_chain(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, model.cfg.n_embd), c0, [0], k, pad=2)


@pytest.mark.parametrize("fused", [False, True])
def test_several_sequences_pad_their_step_one_to_one_length(model, fused):
    """Several sequences with different counts of queued MTP entries (the last round's accepted drafts) share
    one padded step 1 (`step1_pads`: k + 1 rows each, so a round of several is one call, where each step-1
    length took a call of its own): each sequence's padding rows, just before its pending row, are written
    after that row's position and masked from its drafts by position. The drafts, the verification, the
    MTP cache rows kept and the next round's drafts equal those of each sequence alone, unpadded."""
    k, n_mtp = 3, model.cfg.nextn_blocks[0]
    queued = (2, 0)                                 # slot 0: 2 entries queued, slot 1: none
    lens = (17, 12)
    texts = [_text(n, 900 + 50 * s) for s, n in enumerate(lens)]

    def prompt(cache, s):
        t = texts[s]
        out = model(t, cache, [s], logits="none")
        h = shift_hidden(out.hidden)
        model.mtp_forward(t[:, :-1 - queued[s]], h[:, :-1 - queued[s]], cache, [s], logits="none")
        return t[:, -1 - queued[s]:], h[:, -1 - queued[s]:]   # [queued..., pending] and their hidden rows

    def round_(cache, slots, x, h, pad):
        if fused:
            d, out, target = model.draft_and_verify(x, h, cache, slots, k, pad=pad)
            return d, out.logits, target
        d, last = model.draft_chain(x, h, cache, slots, k, pad=pad)
        return d, None, last

    alone = []
    for s in (0, 1):
        c = ModelCache(model.cfg, 2, 64)
        x, h = prompt(c, s)
        d, lg, tail = round_(c, [s], x, h, 0)
        L = c.mtp_lengths[s]
        c.truncate(s, lens[s])
        d2, _ = model.draft_chain(d[:, :1], h[:, -1:], c, [s], k)
        alone.append((d, lg, tail, L, c, d2))
    both = ModelCache(model.cfg, 2, 64)
    xs, hs = zip(*(prompt(both, s) for s in (0, 1)), strict=True)
    pads = model.step1_pads(both, [0, 1], [x.shape[1] for x in xs], k)
    assert pads == [k - queued[0], k - queued[1]]
    # padding rows of any content (the decoder pads with the pending row's) before each pending row
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.cat([x[:, :-1], torch.randint(0, 100, (1, p), generator=g), x[:, -1:]], dim=1)
                   for x, p in zip(xs, pads, strict=True)])
    h = torch.cat([torch.cat([h[:, :-1], torch.randn(1, p, h.shape[-1], generator=g), h[:, -1:]], dim=1)
                   for h, p in zip(hs, pads, strict=True)])
    d, lg, tail = round_(both, [0, 1], x, h, pads)
    for s in (0, 1):
        ad, alg, atail, L, c, ad2 = alone[s]
        assert torch.equal(d[s], ad[0]), s
        assert both.mtp_lengths[s] == L
        assert torch.allclose(both.mtp_k[n_mtp][s, :L], c.mtp_k[n_mtp][s, :L], **TIGHT)
        assert torch.allclose(both.mtp_v[n_mtp][s, :L], c.mtp_v[n_mtp][s, :L], **TIGHT)
        if fused:
            assert torch.equal(tail[s], atail[0]) and torch.allclose(lg[s], alg[0], **TIGHT)
        else:
            assert torch.allclose(tail[s], atail[0], **TIGHT)
    for s in (0, 1):
        both.truncate(s, lens[s])
    d2, _ = model.draft_chain(d[:, :1], torch.cat([h[:1, -1:], h[1:, -1:]]), both, [0, 1], k)
    for s in (0, 1):
        assert torch.equal(d2[s], alone[s][5][0]), s
    assert model.step1_pads(both, [0, 1], [k + 2, 1], k) is None       # a backlog longer than a padded step 1
    with pytest.raises(ValueError, match="padding rows"):
        model.draft_chain(x[:, :2], h[:, :2], both, [0, 1], k, pad=[1, 2])


def _prompt_cache(model, t: torch.Tensor):
    """A one-slot cache holding the prompt t [1, T] in the main model and E(0..T-2) in the MTP cache, and the
    shifted hidden rows (the carry of the pending last token is h[:, -1:])."""
    cache = ModelCache(model.cfg, 1, 64)
    out = model(t, cache, logits="none")
    h = shift_hidden(out.hidden)
    model.mtp_forward(t[:, :-1], h[:, :-1], cache, logits="none")
    return cache, h


def test_wrong_drafts_are_each_drafts_argmax_plus_one(model):
    """`set_wrong_drafts(True)` (the bench's --wrong-drafts) returns every draft as its argmax + 1 mod the
    vocabulary while the chain itself runs unchanged (the same MTP cache rows), in `draft_chain` and in
    `draft_and_verify`, whose verification then rejects them; off again, the chain is the plain one."""
    k = 4
    t = _text(11, 7000)

    got = {}
    for wrong in (False, True, False):
        cache, h = _prompt_cache(model, t)
        model.set_wrong_drafts(wrong)
        try:
            d, _ = model.draft_chain(t[:, -1:], h[:, -1:], cache, [0], k)
            vcache, _ = _prompt_cache(model, t)
            vd, out, target = model.draft_and_verify(t[:, -1:], h[:, -1:], vcache, [0], k)
        finally:
            model.set_wrong_drafts(False)
        assert torch.equal(vd, d) and torch.equal(target, out.logits.argmax(-1))
        assert torch.equal(cache.mtp_k[model.cfg.nextn_blocks[0]][0, :cache.mtp_lengths[0]],
                           vcache.mtp_k[model.cfg.nextn_blocks[0]][0, :vcache.mtp_lengths[0]])
        got.setdefault(wrong, []).append(d)
        if wrong:
            assert not bool((target[:, :1] == d[:, :1]).any())   # the first draft is rejected
    assert torch.equal(got[False][0], got[False][1])
    assert torch.equal(got[True][0], (got[False][0] + 1) % model.cfg.n_vocab)
    assert model.wrong_drafts is False


def test_draft_vocabulary_drafts_among_its_first_token_ids(model):
    """With `set_draft_vocab(n)` a chain drafts the argmax of the MTP logits' first n token ids at every
    step (n is below the largest token the whole vocabulary drafts here, so the chains differ), while
    `mtp_forward` keeps the whole vocabulary; bad sizes are refused and change nothing."""
    from engine.errors import InputError
    k = 4
    t = _text(11, 7000)
    drafts = {}

    n = None
    for vocab in (None, "n"):
        vocab = n if vocab == "n" else None
        cache, h = _prompt_cache(model, t)
        step, _ = _prompt_cache(model, t)
        want, tok, hid = [], t[:, -1:], h[:, -1:]
        for _ in range(k):
            mo = model.mtp_forward(tok, hid, step, logits="last")
            assert mo.logits.shape[-1] == model.cfg.n_vocab
            tok, hid = mo.logits[:, -1:, :vocab].argmax(-1), mo.hidden
            want.append(tok)
        try:
            model.set_draft_vocab(vocab)
            got, _ = model.draft_chain(t[:, -1:], h[:, -1:], cache, [0], k)
        finally:
            model.set_draft_vocab(None)
        assert torch.equal(got, torch.cat(want, dim=1)), vocab
        drafts[vocab] = got
        if vocab is None:
            n = int(got.max())       # the next pass leaves out the largest token drafted here
    assert n > 0 and (drafts[n] < n).all() and not torch.equal(drafts[n], drafts[None])
    for bad in (0, model.cfg.n_vocab + 1):
        with pytest.raises(InputError, match="draft vocabulary"):
            model.set_draft_vocab(bad)
    assert model.draft_vocab is None
    model.set_draft_vocab(model.cfg.n_vocab)           # the whole vocabulary: the same as None
    assert model.draft_vocab is None


@pytest.mark.parametrize("kind", ["q8_0", "int8", "int8_dots"])
def test_draft_weights_leave_the_mtp_cache_exact(model, kind):
    """With `set_draft_weights('q8_0')` a chain multiplies by Q8_0 copies of the nextn block's matrices and
    of the head ('int8': int8 copies with a scale per row; 'int8_dots': those by the CPU's 8-bit dot
    products), except attn_k / attn_v (the same tensors) and, for
    the row its first step keeps in the MTP cache, eh_proj: the cache after the chain is bitwise the one exact
    drafting leaves, while the drafts' hidden state comes from the copies (it differs where the file's
    weights are float); 'exact' undoes it."""
    from engine.errors import InputError
    from engine.kernels import PackedWeight, int8_dots
    if kind == "int8_dots" and not int8_dots.available():
        pytest.skip(f"int8 dot products {int8_dots.status()[1]}")
    k = 4
    t = _text(13, 5000)
    n = model.cfg.nextn_blocks[0]
    runs = {}
    for run in ("exact", kind, "exact"):
        cache = ModelCache(model.cfg, 1, 64)
        out = model(t[:, :-2], cache, logits="none")
        h = shift_hidden(out.hidden)
        model.mtp_forward(t[:, :-2], h, cache, logits="none")
        o2 = model(t[:, -2:-1], cache, logits="none")
        rows, hid = t[:, -2:], torch.cat([out.hidden[:, -1:], o2.hidden], dim=1)   # a queued entry + pending
        try:
            model.set_draft_weights(run)
            drafts, last = model.draft_chain(rows, hid, cache, [0], k)
            twin = model._draft.get(n)
        finally:
            model.set_draft_weights("exact")
        L = cache.mtp_lengths[0]
        runs.setdefault(run, []).append((drafts, last, cache.mtp_k[n][0, :L].clone(), cache.mtp_v[n][0, :L].clone(), L))
        if run != "exact":
            blk = model.blk[n]
            assert twin.block.mixer.attn_k.weight is blk.mixer.attn_k.weight
            assert twin.block.mixer.attn_v.weight is blk.mixer.attn_v.weight
            assert twin.block.attn_norm.weight is blk.attn_norm.weight
            copies = [twin.block.mixer.attn_q, twin.block.mixer.attn_output, twin.block.nextn.eh_proj]
            group = 32 if run == "q8_0" else None                 # a Q8_0 block, or a whole row
            form = "Q8_0" if run == "q8_0" else "I8"                # int8_dots: I8 rows, quants + 128
            for mod, orig in zip(copies, [blk.mixer.attn_q, blk.mixer.attn_output, blk.nextn.eh_proj], strict=True):
                assert isinstance(mod.weight, PackedWeight) and mod.weight.ggml_type.name == form
                w = orig.weight.dense() if isinstance(orig.weight, PackedWeight) else orig.weight
                blocks = w.reshape(w.shape[0], -1, group or w.shape[1])
                err = (mod.weight.dense() - w).abs().reshape(blocks.shape).amax(-1)
                # half a step (d = max|x| / 127), plus (Q8_0) d's rounding to float16 for |q| <= 127
                assert (err <= blocks.abs().amax(-1) / 127 * 0.57 + 1e-12).all()
            assert isinstance(twin.head, PackedWeight) and twin.head.ggml_type.name == form
            # Q8_0: as_words where compiled kernels run AVX2 code
            layout = {"int8": "q", "int8_dots": "qu"}.get(run, "qw" if codegen.avx2() else "qs")
            assert layout in twin.head.parts and layout in twin.block.mixer.attn_q.weight.parts
            assert not any(mod is orig for mod, orig in zip(twin.block.modules(), blk.modules(), strict=True))
            if run == "int8_dots":   # products of one input joined: one operator call each
                from engine.model.attention import GatedAttention
                from engine.model.layers import SwiGLU
                joined = [(m.draft_gate_up, [m.ffn_gate, m.ffn_up]) for m in twin.block.modules()
                          if isinstance(m, SwiGLU)]
                joined += [(m.draft_qkv, [m.attn_q, m.attn_k, m.attn_v]) for m in twin.block.modules()
                           if isinstance(m, GatedAttention)]
                assert joined
                for w, parts in joined:
                    # each part's rows as its own int8 copy holds them (attn_k / attn_v: copied for this only)
                    own = [p.weight if isinstance(p.weight, PackedWeight) and "qu" in p.weight.parts else
                           PackedWeight.int8_rows_of("x", p.weight.dense() if isinstance(p.weight, PackedWeight)
                                                     else p.weight).as_int8_dots() for p in parts]
                    assert torch.equal(w.parts["qu"], torch.cat([o.parts["qu"] for o in own]))
                    assert torch.equal(w.parts["d"], torch.cat([o.parts["d"] for o in own]))
                assert all(getattr(m, "draft_gate_up", None) is None and getattr(m, "draft_qkv", None) is None
                           for m in blk.modules())
    (e1, e2), (q,) = runs["exact"], runs[kind]
    assert all(torch.equal(a, b) for a, b in zip(e1[:4], e2[:4], strict=True))  # 'exact' restores it
    assert e1[4] == q[4] and torch.equal(e1[2], q[2]) and torch.equal(e1[3], q[3])
    assert torch.equal(q[0][:, 0], e1[0][:, 0])             # this text's first draft: no near tie
    diff = (q[1] - e1[1]).abs().max().item()
    assert diff < 0.05 * e1[1].abs().max().item()
    if model.cfg.arch == "qwen35":                           # the F32 fixture: the copies are not its weights
        assert diff > 0
    with pytest.raises(InputError, match="draft weights: expected one of exact, q8_0, int8"):
        model.set_draft_weights("q4")
    assert model.draft_weights == "exact" and not model._draft


@pytest.mark.parametrize("kind", ["int8", "int8_dots"])
def test_a_quantized_files_draft_weights_get_int8_copies_too(kind):
    """A quantized file's packed matrices (here Q4_K, and Q6_K for the head and ffn_down) get the int8 copies
    that float files' do: rows dequantized, then rounded per row (within half a step of the dequantized
    weight), joined where `int8_dots` joins them; 'q8_0' gives them Q8_0 copies (rounded per block of 32,
    in the words layout where the compiled kernels run AVX2 code). The chain's first draft and its MTP cache
    rows are exact drafting's."""
    from engine.kernels import PackedWeight, codegen, int8_dots
    from engine.model import load_model
    from tests.conftest import fixture_path
    if kind == "int8_dots" and not int8_dots.available():
        pytest.skip(f"int8 dot products {int8_dots.status()[1]}")
    model = load_model(fixture_path("models/tiny-qwen35-q4_k_m.gguf"), packed=True, min_packed=0)
    n = model.cfg.nextn_blocks[0]
    blk = model.blk[n]
    assert blk.mixer.attn_q.weight.ggml_type.name == "Q4_K" and model.output.weight.ggml_type.name == "Q6_K"
    t = _text(13, 5000)
    runs = {}
    for run in ("exact", kind, "q8_0"):
        cache = ModelCache(model.cfg, 1, 64)
        out = model(t[:, :-1], cache, logits="none")
        model.mtp_forward(t[:, :-1], shift_hidden(out.hidden), cache, logits="none")
        try:
            model.set_draft_weights(run)
            drafts, _ = model.draft_chain(t[:, -1:], out.hidden[:, -1:], cache, [0], 3)
            twin = model._draft.get(n)
        finally:
            model.set_draft_weights("exact")
        L = cache.mtp_lengths[0]
        runs[run] = (drafts, cache.mtp_k[n][0, :L].clone(), L)
        if run in (kind, "q8_0"):
            ggml, layout = {"int8": ("I8", "q"), "int8_dots": ("I8", "qu"),
                            "q8_0": ("Q8_0", "qw" if codegen.avx2() else "qs")}[run]
            for mod, orig in ((twin.block.mixer.attn_q, blk.mixer.attn_q), (twin.block.nextn.eh_proj, blk.nextn.eh_proj),
                              (twin.block.ffn.ffn_down, blk.ffn.ffn_down), (None, model.output)):
                w = twin.head if mod is None else mod.weight
                assert isinstance(w, PackedWeight) and w.ggml_type.name == ggml and layout in w.parts
                dense = orig.weight.dense()
                err = (w.dense() - dense).abs().amax(-1)
                assert (err <= dense.abs().amax(-1) / 127 * 0.57 + 1e-12).all()
            if run == "int8_dots":
                assert twin.block.ffn.draft_gate_up is not None and twin.block.mixer.draft_qkv is not None
    (e, cq, nq) = runs["exact"]
    for run in (kind, "q8_0"):
        d, c, L = runs[run]
        assert L == nq and torch.equal(c, cq) and torch.equal(d[:, 0], e[:, 0]), run


def test_context_overflow_is_an_input_error(model):
    from engine.errors import InputError
    cache = ModelCache(model.cfg, 1, 8)
    with pytest.raises(InputError, match="n_ctx=8"):
        model(_text(9), cache)
