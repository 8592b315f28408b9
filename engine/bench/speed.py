"""Engine speed on one model: decode/prefill tokens/s against the read-bandwidth bound measured in
the same run, the relative cost of verifying k+1 rows, of an MTP draft and of a rollback, host
(Python) time per step and peak RSS. Returns plain dicts; `mtpchat bench --synthetic` prints them.

Timings are medians of interleaved repeats; nothing here prints.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from dataclasses import dataclass

import torch

from engine.kernels import PackedWeight, fused


@dataclass(frozen=True)
class SpeedSettings:
    prompt_tokens: int = 128      # prefill length
    decode_tokens: int = 32       # timed decode steps
    verify_k: tuple[int, ...] = (1, 2, 3, 4)
    repeats: int = 5              # repeats of prefill / verify / draft / rollback timings
    bandwidth_mib: int = 256      # buffer read for the bandwidth figure (far beyond the caches)


def measure_read_bandwidth(mib: int = 256, repeats: int = 9, device: torch.device | str = "cpu") -> list[float]:
    """GB/s of `torch.sum` over a float32 buffer of `mib` MiB with the current torch threads (on a GPU:
    its memory; the buffer is 16x larger there, beyond its caches)."""
    device = torch.device(device)
    if device.type == "cuda":
        mib *= 16
    buf = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=device)
    float(buf.sum())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        float(buf.sum())
        out.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    del buf
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _weight_bytes(t) -> int:
    if isinstance(t, PackedWeight):
        return t.nbytes
    return t.numel() * t.element_size()


def bytes_per_decode_step(model) -> int:
    """Weight bytes one plain decode step reads: main blocks (MoE: the routed share of the experts)
    and the output head; not the MTP block, not the embedding table unless it is the (tied) head."""
    cfg = model.cfg
    total = 0
    for i in range(cfg.n_layer):
        for mod in model.blk[i].modules():
            for t in list(mod._parameters.values()) + [v for v in vars(mod).values()
                                                   if isinstance(v, PackedWeight)]:
                if t is None:
                    continue
                b = _weight_bytes(t)
                if t.ndim == 3 and cfg.is_moe:  # stacked experts: k of X are read per token
                    b = b * cfg.n_expert_used // cfg.n_expert
                total += b
    head = model.token_embd.weight if model.output is None else model.output.weight
    total += _weight_bytes(head) + model.output_norm.weight.numel() * 4
    return total


def weight_inventory(model) -> dict[str, int]:
    """How many weights run packed per GGUF type, and how many as dense float tensors."""
    inv: dict[str, int] = {}
    for mod in model.modules():
        for v in vars(mod).values():
            if isinstance(v, PackedWeight):
                inv[f"packed {v.ggml_type.name}"] = inv.get(f"packed {v.ggml_type.name}", 0) + 1
        for p in mod._parameters.values():
            if p is not None and p.ndim >= 2:
                key = f"dense {str(p.dtype).replace('torch.', '')}"
                inv[key] = inv.get(key, 0) + 1
    return inv


def describe_weights(inventory: dict[str, int]) -> str:
    """`weight_inventory`'s counts as one phrase: '27 packed Q8_0, 4 dense float32'."""
    return ", ".join(f"{n} {form}" for form, n in sorted(inventory.items())) or "none"


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def run_speed(model, settings: SpeedSettings = SpeedSettings(), profile: bool = False,
              bandwidth: list[float] | None = None) -> dict:
    """Measure one loaded model (CPU). See the module docstring for what. `bandwidth`: GB/s samples
    measured earlier in the same run (before the model was built, so the buffer does not add to the
    peak RSS); measured here when None."""
    from engine.memory import engine_kv_dtype
    from engine.model.cache import ModelCache

    s = settings
    cfg = model.cfg
    dev = model.device
    gen = torch.Generator().manual_seed(0)
    n_ctx = s.prompt_tokens + s.decode_tokens + 64
    prompt = torch.randint(0, cfg.n_vocab, (1, s.prompt_tokens), generator=gen).to(dev)
    bw = bandwidth or measure_read_bandwidth(s.bandwidth_mib, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    res: dict = {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                 "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                 "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                 "load_average_before": list(os.getloadavg())}
    mode, reason = fused.status()
    res["compute_path"] = {"kernels": mode, "why": reason, "weights": weight_inventory(model)}

    with torch.inference_mode():
        cache = ModelCache(cfg, 1, n_ctx, mtp=cfg.has_mtp, device=dev,
                           kv_dtype={"bf16": torch.bfloat16, "f32": torch.float32}[engine_kv_dtype(dev.type)])
        # warm-up: compiles every kernel the timed runs use (prefill, decode, verify rows, MTP)
        t_warm = time.perf_counter()
        out = model.forward(prompt, cache, logits="last")
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for k in (0, *s.verify_k):
            rows = tok.repeat(1, k + 1)
            o = model.forward(rows, cache, logits="all", gdn_steps=True)
            cache.rollback(o.gdn_steps, [1])
        if cfg.has_mtp:
            model.mtp_forward(tok, out.hidden[:, -1:], cache, logits="last")
            cache.truncate_mtp(0, 0)
        res["warmup_s"] = round(time.perf_counter() - t_warm, 2)

        # prefill
        pre = []
        for _ in range(s.repeats):
            cache.reset(0)
            t0 = time.perf_counter()
            out = model.forward(prompt, cache, logits="last")
            sync()
            pre.append(time.perf_counter() - t0)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        hidden = out.hidden[:, -1:]

        # decode: the plain greedy loop, one host read per step
        steps = []
        for _ in range(s.decode_tokens):
            t0 = time.perf_counter()
            o = model.forward(tok, cache, logits="last")
            tok = o.logits[:, -1].argmax(-1, keepdim=True)
            int(tok)
            steps.append(time.perf_counter() - t0)
        step_ms = _median_ms(steps)

        # verification of k+1 rows, MTP draft and rollback, interleaved per repeat
        ver: dict[int, list[float]] = {k: [] for k in s.verify_k}
        one, draft, back = [], [], []
        for _ in range(s.repeats):
            t0 = time.perf_counter()
            o = model.forward(tok, cache, logits="last")
            int(o.logits[:, -1].argmax())
            one.append(time.perf_counter() - t0)
            cache.truncate(0, cache.lengths[0] - 1)  # GDN state is not restored: timing only
            for k in s.verify_k:
                rows = tok.repeat(1, k + 1)
                t0 = time.perf_counter()
                o = model.forward(rows, cache, logits="all", gdn_steps=True)
                int(o.logits[:, -1].argmax())
                ver[k].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                cache.rollback(o.gdn_steps, [1])
                sync()
                back.append(time.perf_counter() - t0)
                cache.truncate(0, cache.lengths[0] - 1)
            if cfg.has_mtp:
                n_mtp = cache.mtp_lengths[0]
                t0 = time.perf_counter()
                m = model.mtp_forward(tok, hidden, cache, logits="last")
                int(m.logits[:, -1].argmax())
                draft.append(time.perf_counter() - t0)
                cache.truncate_mtp(0, n_mtp)
        one_ms = _median_ms(one)

        host_ms, table = _host_time(model, cache, tok, profile)

    bytes_step = bytes_per_decode_step(model)
    bw_med = statistics.median(bw)
    decode_tps = 1e3 / step_ms
    res.update({
        "read_bandwidth_gbs": round(bw_med, 2), "read_bandwidth_samples_gbs": [round(b, 2) for b in bw],
        "bytes_per_decode_step": bytes_step,
        "decode_tok_s": round(decode_tps, 2), "decode_step_ms": round(step_ms, 3),
        "bound_tok_s": round(bw_med * 1e9 / bytes_step, 2),
        "bound_pct": round(100 * decode_tps * bytes_step / (bw_med * 1e9), 1),
        "prefill_tokens": s.prompt_tokens, "prefill_tok_s": round(s.prompt_tokens / statistics.median(pre), 2),
        "verify_ms": {str(k): round(_median_ms(v), 3) for k, v in ver.items()},
        "verify_cost": {str(k): round(_median_ms(v) / one_ms, 3) for k, v in ver.items()},
        "mtp_draft_ms": round(_median_ms(draft), 3) if draft else None,
        "mtp_draft_cost": round(_median_ms(draft) / one_ms, 3) if draft else None,
        "rollback_ms": round(_median_ms(back), 3),
        "rollback_cost": round(_median_ms(back) / one_ms, 3),
        "host_ms_per_step": round(host_ms, 3),
        "peak_rss_bytes": peak_rss_bytes(),
        "load_average_after": list(os.getloadavg()),
    })
    if table is not None:
        res["profile"] = table
    return res


def _host_time(model, cache, tok, profile: bool) -> tuple[float, str | None]:
    """Host time of one decode step: its wall time minus the time inside top-level torch ops
    (as the profiler sees them; the profiler's own cost makes this an upper bound)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        o = model.forward(tok, cache, logits="last")
        int(o.logits[:, -1].argmax())
        wall_us = (time.perf_counter() - t0) * 1e6
    cache.truncate(0, cache.lengths[0] - 1)
    top = [e for e in prof.events() if e.cpu_parent is None]
    in_ops = sum(e.cpu_time_total for e in top)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25) if profile else None
    return max(0.0, wall_us - in_ops) / 1e3, table


def gpu_row(f=None, settings: SpeedSettings = SpeedSettings(), steps: str = "eager") -> dict:
    """The GPU part of the bench: the same measurement with bf16 weights and KV on the first CUDA
    device (when a model file `f` is given), or the reason there is none. steps='compiled' compiles
    whole steps (Triton) before timing them."""
    if not torch.cuda.is_available():
        return {"available": False, "reason": "no CUDA device"}
    row = {"available": True, "device": torch.cuda.get_device_name(0)}
    if f is not None:
        from engine.model import load_model

        model = load_model(f, device="cuda", dtype=torch.bfloat16)
        row["steps"] = model.compile_steps("compiled", background=False)[1] if steps == "compiled" else "eager"
        torch.cuda.reset_peak_memory_stats()
        res = run_speed(model, settings)
        keep = ("read_bandwidth_gbs", "bytes_per_decode_step", "decode_tok_s", "decode_step_ms", "bound_tok_s",
                "bound_pct", "prefill_tok_s", "verify_cost", "mtp_draft_cost", "rollback_cost",
                "host_ms_per_step")
        row.update({k: res[k] for k in keep}, dtype="bfloat16", peak_cuda_bytes=torch.cuda.max_memory_allocated())
        del model
        torch.cuda.empty_cache()
    return row
