"""Mixture-of-experts FFN of `qwen35moe` (spec/qwen35-gguf.md §4.6): softmax router over all experts,
top-k, renormalised weights, plus one shared expert scaled by a sigmoid gate.

Expert weights are 3-D `(X, out, in)`; every multiply goes through `matmul_weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import PackedWeight, fused
from engine.model.layers import Linear, matmul_weight


class ExpertWeights(nn.Module):
    """Stacked per-expert projection weights `(X, out, in)` (GGUF `ne[in, out, X]`)."""

    def __init__(self, n_expert: int, n_in: int, n_out: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_expert, n_out, n_in, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return matmul_weight(x, self.weight[expert])


class MoE(nn.Module):
    """Tensors ffn_gate_inp, ffn_{gate,up,down}_exps, ffn_gate_inp_shexp, ffn_{gate,up,down}_shexp."""

    def __init__(self, cfg, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        E, X, Fe, Fs = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
        self.n_used = cfg.n_expert_used
        self.ffn_gate_inp = Linear(E, X, dtype, device)
        self.ffn_gate_exps = ExpertWeights(X, E, Fe, dtype, device)
        self.ffn_up_exps = ExpertWeights(X, E, Fe, dtype, device)
        self.ffn_down_exps = ExpertWeights(X, Fe, E, dtype, device)
        self.ffn_gate_inp_shexp = Linear(E, 1, dtype, device)
        self.ffn_gate_shexp = Linear(E, Fs, dtype, device)
        self.ffn_up_shexp = Linear(E, Fs, dtype, device)
        self.ffn_down_shexp = Linear(Fs, E, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])                                    # [N, E]
        probs = torch.softmax(self.ffn_gate_inp(x2).float(), dim=-1)     # [N, X]
        top_w, top_i = probs.topk(self.n_used, dim=-1)                   # [N, k]
        top_w = top_w / top_w.sum(-1, keepdim=True)
        if torch.compiler.is_compiling():
            routed = self._gathered(x2, top_i, top_w)   # no data-dependent control flow to trace
        else:
            routed = self._by_expert(x2, top_i, top_w)
        shared = self.ffn_down_shexp(F.silu(self.ffn_gate_shexp(x2)) * self.ffn_up_shexp(x2))
        out = routed + torch.sigmoid(self.ffn_gate_inp_shexp(x2)) * shared
        return out.reshape(shape)

    def _gathered(self, x2, top_i, top_w):
        """The compiled step's form (a few rows): each row multiplies the gathered weights of its k
        experts: the products of `_by_expert`, summed in another order (last-bit differences)."""
        def proj(w, h):   # w [X, out, in], h [N, k, in] -> [N, k, out]
            if isinstance(w, PackedWeight):
                # the selected experts' blocks, dequantized inside one reduction (only their bytes read)
                wk = fused.dequant_gathered(w.ggml_type, w.parts, top_i)      # [N, k, out, in] float32
                return fused.realized(h)[:, :, None, :].mul(wk).sum(-1)
            wk = w[top_i]
            return torch.einsum("nki,nkoi->nko", h.to(wk.dtype), wk).float()

        xk = x2[:, None, :].expand(-1, top_i.shape[1], -1)
        g = proj(self.ffn_gate_exps.weight, xk)
        u = proj(self.ffn_up_exps.weight, xk)
        y = proj(self.ffn_down_exps.weight, F.silu(g) * u)                  # [N, k, E]
        return (y * top_w[..., None]).sum(1)

    def _by_expert(self, x2, top_i, top_w):
        routed = torch.zeros_like(x2, dtype=torch.float32)
        for e in torch.unique(top_i).tolist():
            rows, which = torch.nonzero(top_i == e, as_tuple=True)
            h = x2[rows]
            y = self.ffn_down_exps(F.silu(self.ffn_gate_exps(h, e)) * self.ffn_up_exps(h, e), e)
            routed = routed.index_add(0, rows, y * top_w[rows, which, None])
        return routed
