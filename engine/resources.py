"""Where the bundled demo model lives (issue 6): the one lookup every command and the app use when no
model is given. Never downloads anything; the file ships in resources/.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import InputError

DEMO_MODEL_NAME = "demo-qwen35.gguf"
RESOURCES_DIR = Path(__file__).resolve().parent.parent / "resources"


def default_model_path() -> Path:
    """The bundled demo model: $MTPCHAT_DEFAULT_MODEL if set, else resources/demo-qwen35.gguf.
    Raises InputError (one line for the CLI) when the file is not there."""
    env = os.environ.get("MTPCHAT_DEFAULT_MODEL")
    path = Path(env) if env else RESOURCES_DIR / DEMO_MODEL_NAME
    if not path.is_file():
        raise InputError(f"model: no model given and the bundled demo model {path} is missing")
    return path


def compile_cache_dir() -> Path:
    """mtpchat's folder for torch.compile's on-disk caches (inductor's generated C++ / Triton and their
    builds): the user cache folder (platformdirs: ~/.cache/mtpchat/inductor on Linux)."""
    import platformdirs

    return platformdirs.user_cache_path("mtpchat", appauthor=False) / "inductor"


def use_compile_cache() -> str:
    """Point inductor's cache at `compile_cache_dir()` unless $TORCHINDUCTOR_CACHE_DIR says otherwise;
    returns the folder set ("" for inductor's default). Inductor's default is a folder in the temp
    directory, which many systems empty at boot or after days: compiling a model's kinds of steps again
    takes minutes (the demo model's 5 kinds for `--mtp on --draft 3`: ~1.5 on an AMD EPYC; every kind of a
    demo bench: ~30 on a 2-vCPU Xeon), decoding eagerly meanwhile (README, docs/benchmarks.md). Without a
    writable folder on the way (a read-only home) inductor's default stays; nothing is created here
    (inductor makes the folder when it compiles)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        folder = compile_cache_dir()
        probe = folder
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        if probe.is_dir() and os.access(probe, os.W_OK | os.X_OK):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
