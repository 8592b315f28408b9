"""Shared test set-up: Qt offscreen, the fixture folder (MTPCHAT_FIXTURES, default ../shared/fixtures)."""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

import pytest


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"


os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# commands default to compiled steps in the background (`--steps auto`); tests run the eager path unless a
# test asks for compiled steps itself (tests/engine/model/test_steps.py), so the suite does not compile
os.environ.setdefault("MTPCHAT_STEPS", "eager")
# the tests that compile keep inductor's own default cache folder (the temp directory), not the user cache
# folder that `mtpchat` commands use (engine.resources.use_compile_cache)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{_user()}"))

REPO = Path(__file__).resolve().parent.parent


def _default_fixtures() -> Path:
    for candidate in (REPO.parent / "shared" / "fixtures", Path("/work/shared/fixtures")):
        if candidate.is_dir():
            return candidate
    return REPO.parent / "shared" / "fixtures"


FIXTURES = Path(os.environ.get("MTPCHAT_FIXTURES") or _default_fixtures()).resolve()


def fixture_path(rel: str) -> Path:
    """Path of a file in the shared fixtures, or skip the test saying which file is missing."""
    p = FIXTURES / rel
    if not p.exists():
        pytest.skip(f"fixture {rel} not found under MTPCHAT_FIXTURES={FIXTURES}")
    return p


@pytest.fixture
def one_torch_thread():
    """torch on one thread during the test (many small steps: faster so on a 2-core machine)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip(f"MTPCHAT_FIXTURES={FIXTURES} does not exist")
    return FIXTURES


def record_load_threads(monkeypatch, module) -> list:
    """The threads `module.load_model_as` runs in from now on (a command module that loads a model)."""
    import threading

    seen = []
    real = module.load_model_as

    def load(*a, **kw):
        seen.append(threading.current_thread())
        return real(*a, **kw)

    monkeypatch.setattr(module, "load_model_as", load)
    return seen
