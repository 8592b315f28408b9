"""GGUF files: a checked header, owned metadata and tensor bytes (spec/qwen35-gguf.md §2-§3).

Public API: `open_gguf(path) -> GGUFFile`. Every problem with the file raises `ModelFileError`.
"""

from engine.gguf.reader import GGUFFile, TensorInfo, open_gguf

__all__ = ["GGUFFile", "TensorInfo", "open_gguf"]
