"""GGUF files: a checked header, owned metadata and tensor bytes (spec/qwen35-gguf.md §2-§3).

`open_gguf(path)` checks and parses the header of any GGUF (a model or a tokenizer-only file);
`load_model_file(path)` adds the config and the semantic checks of a qwen35/qwen35moe model.
Every problem with a file raises `ModelFileError`; nothing here memory-maps the file.
"""

from engine.gguf.reader import GGUFFile, TensorInfo, open_gguf
from engine.gguf.validate import ModelFile, check_model_gguf, load_model_file

__all__ = ["GGUFFile", "ModelFile", "TensorInfo", "check_model_gguf", "load_model_file", "open_gguf"]
