"""The Qwen3.5/3.6 model in PyTorch: modules named like the GGUF tensors, caches for N slots, the
MTP head (spec/qwen35-gguf.md §4-§7)."""

from engine.model.cache import GDNSnapshot, GDNSteps, ModelCache
from engine.model.model import ForwardOutput, MTPOutput, Qwen35Model, gguf_name, load_model
from engine.model.mtp import shift_hidden

__all__ = ["ForwardOutput", "GDNSnapshot", "GDNSteps", "MTPOutput", "ModelCache", "Qwen35Model",
           "gguf_name", "load_model", "shift_hidden"]
