"""Records the input of every weight multiply of a `Qwen35Model` into `ImatrixStats` (spec/mtp-speculation.md §9.1).

Hooks from outside the model, nothing changed inside it: a forward pre-hook on every `Linear` and
`ExpertWeights` module (their parameter names are the GGUF names) and a wrapper around `model.head`, which
multiplies `output.weight` directly. Hooks exist only inside the `with` block.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.imatrix.stats import ImatrixStats
from engine.model import Qwen35Model, gguf_name
from engine.model.layers import Linear
from engine.model.moe import ExpertWeights

OUTPUT_WEIGHT = "output.weight"


def multiplied_weight_names(model: Qwen35Model) -> dict[torch.nn.Module, str]:
    """Module -> GGUF name of the weight it multiplies, for every projection module of the model.

    `token_embd` is a table lookup, not a multiply; a module shared by two blocks (the ik form of a nextn
    block without its own attn_q) keeps the name of the tensor it holds."""
    names: dict[torch.nn.Module, str] = {}
    for path, module in model.named_modules():
        if path == "token_embd" or path.endswith((".embed_tokens", ".shared_head_head")):
            continue
        if isinstance(module, (Linear, ExpertWeights)) and module not in names:
            names[module] = gguf_name(f"{path}.weight")
    return names


class ImatrixCollector:
    """`with ImatrixCollector(model, stats): model(...)` adds each multiply's input activations to `stats`.

    include_output: also record the output head's input as `output.weight` (llama.cpp's `--process-output`);
    a tied head (no output.weight) is `token_embd.weight`, which llama.cpp never collects, so it is skipped."""

    def __init__(self, model: Qwen35Model, stats: ImatrixStats, include_output: bool = True):
        self.model = model
        self.stats = stats
        self.include_output = include_output
        self._handles: list[Any] = []
        self._head_wrapped = False

    def __enter__(self) -> ImatrixCollector:
        for module, name in multiplied_weight_names(self.model).items():
            if isinstance(module, ExpertWeights):
                hook = self._expert_hook(name, module.weight.shape[0])
            else:
                hook = self._dense_hook(name)
            self._handles.append(module.register_forward_pre_hook(hook))
        if self.include_output and self.model.output is not None:
            head = self.model.head  # bound method of the class

            def recording_head(h: torch.Tensor) -> torch.Tensor:
                self.stats.add_dense(OUTPUT_WEIGHT, h)
                return head(h)

            self.model.head = recording_head  # instance attribute shadows the method until __exit__
            self._head_wrapped = True
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._head_wrapped:
            del self.model.head
            self._head_wrapped = False

    def _dense_hook(self, name: str):
        stats = self.stats

        def hook(module: torch.nn.Module, args: tuple) -> None:
            stats.add_dense(name, args[0])

        return hook

    def _expert_hook(self, name: str, n_expert: int):
        stats = self.stats

        def hook(module: torch.nn.Module, args: tuple) -> None:
            x, expert = args[0], args[1]
            stats.add_expert(name, n_expert, int(expert), x)

        return hook
