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
