"""Per-weight activation statistics: the sums llama.cpp's imatrix collector keeps (spec/mtp-speculation.md §9.1).

For every weight that multiplies an activation matrix X (rows = tokens, columns = the weight's input
dimension) we keep Σ_rows X², Σ_rows X and the number of rows, per matrix (one for a dense weight, one per
expert for a stacked 3-D expert weight). Accumulators stay on the activations' device in float64 so that a
long run costs no host synchronisation and no float32 drift; nothing here knows about the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# llama.cpp ignores dense MUL_MATs with fewer activation rows (tools/imatrix/imatrix.cpp, `collect_imatrix`).
MIN_DENSE_ROWS = 16


@dataclass
class ImatrixEntry:
    """Finished statistics of one weight, host side. `n_mat` = 1 (dense) or the number of experts."""

    in_sum2: np.ndarray  # [n_mat, n_cols] float64: Σ x² per input column
    in_sum: np.ndarray   # [n_mat, n_cols] float64: Σ x per input column
    counts: np.ndarray   # [n_mat] int64: activation rows seen per matrix

    @property
    def n_mat(self) -> int:
        return self.in_sum2.shape[0]

    @property
    def n_cols(self) -> int:
        return self.in_sum2.shape[1]


class _Accumulator:
    def __init__(self, n_mat: int, n_cols: int, device: torch.device):
        self.in_sum2 = torch.zeros(n_mat, n_cols, dtype=torch.float64, device=device)
        self.in_sum = torch.zeros(n_mat, n_cols, dtype=torch.float64, device=device)
        self.counts = torch.zeros(n_mat, dtype=torch.int64, device=device)


class ImatrixStats:
    """Accumulates activation statistics per weight name (the GGUF tensor name, e.g. `blk.3.attn_q.weight`)."""

    def __init__(self) -> None:
        self._acc: dict[str, _Accumulator] = {}

    def _get(self, name: str, n_mat: int, n_cols: int, device: torch.device) -> _Accumulator:
        acc = self._acc.get(name)
        if acc is None:
            acc = self._acc[name] = _Accumulator(n_mat, n_cols, device)
        elif acc.in_sum2.shape != (n_mat, n_cols):
            raise ValueError(f"{name}: activation shape [{n_mat}, {n_cols}] differs from earlier "
                             f"[{acc.in_sum2.shape[0]}, {acc.in_sum2.shape[1]}]")
        return acc

    def add_dense(self, name: str, x: torch.Tensor) -> None:
        """Input `x` [..., n_cols] of a 2-D weight; every leading index is one row. Skips < 16 rows, as llama.cpp."""
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.shape[0] < MIN_DENSE_ROWS:
            return
        acc = self._get(name, 1, x2d.shape[1], x2d.device)
        xd = x2d.detach().to(torch.float64)
        acc.in_sum2[0] += (xd * xd).sum(0)
        acc.in_sum[0] += xd.sum(0)
        acc.counts[0] += x2d.shape[0]

    def add_experts(self, name: str, n_expert: int, x: torch.Tensor, expert_ids: torch.Tensor) -> None:
        """Inputs of a stacked expert weight [n_expert, out, in], as ggml's MUL_MAT_ID sees them.

        `expert_ids` [T, k] are the experts chosen per token; `x` [T, k, n_cols] is the input each (token,
        slot) pair sends to its expert, or [T, n_cols] when every slot of a token sends the same row (the
        gate/up projections). Each (token, slot) pair adds one row to its expert's sums and one to its count.
        """
        ids = expert_ids.reshape(expert_ids.shape[0], -1)
        if x.dim() == 2:
            x = x.unsqueeze(1).expand(-1, ids.shape[1], -1)
        if x.shape[:2] != ids.shape:
            raise ValueError(f"{name}: inputs {tuple(x.shape)} do not match expert ids {tuple(ids.shape)}")
        rows = x.reshape(-1, x.shape[-1]).detach().to(torch.float64)
        flat_ids = ids.reshape(-1).to(torch.int64)
        acc = self._get(name, n_expert, rows.shape[1], rows.device)
        acc.in_sum2.index_add_(0, flat_ids, rows * rows)
        acc.in_sum.index_add_(0, flat_ids, rows)
        acc.counts += torch.bincount(flat_ids, minlength=n_expert)

    def add_expert(self, name: str, n_expert: int, expert: int, x: torch.Tensor) -> None:
        """Inputs `x` [..., n_cols] routed to one expert of a stacked expert weight (no row minimum, as MUL_MAT_ID)."""
        x2d = x.reshape(-1, x.shape[-1])
        acc = self._get(name, n_expert, x2d.shape[1], x2d.device)
        xd = x2d.detach().to(torch.float64)
        acc.in_sum2[expert] += (xd * xd).sum(0)
        acc.in_sum[expert] += xd.sum(0)
        acc.counts[expert] += x2d.shape[0]

    def names(self) -> list[str]:
        return sorted(self._acc)

    def check_finite(self) -> str | None:
        """Name of the first weight whose sums are not finite (llama.cpp aborts on those), else None."""
        names = self.names()
        if not names:
            return None
        finite = torch.stack([torch.isfinite(self._acc[n].in_sum2).all() for n in names]).cpu()  # one sync
        bad = [n for n, ok in zip(names, finite.tolist(), strict=True) if not ok]
        return bad[0] if bad else None

    def entries(self) -> dict[str, ImatrixEntry]:
        """Host copies of every entry, sorted by name (the order llama.cpp writes them in)."""
        out = {}
        for name in self.names():
            acc = self._acc[name]
            out[name] = ImatrixEntry(acc.in_sum2.cpu().numpy().copy(), acc.in_sum.cpu().numpy().copy(),
                                     acc.counts.cpu().numpy().copy())
        return out
