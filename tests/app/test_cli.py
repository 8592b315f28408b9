import os
import subprocess
import sys

import pytest


def test_unknown_flag_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "app", "--no-such-flag"], capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_help_lists_verbs():
    r = subprocess.run([sys.executable, "-m", "app", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    assert "mtpchat" in r.stdout


def test_no_verb_without_a_terminal_says_what_exists():
    # `make run` from a script: no desktop app yet and no terminal to chat in -> a clear message, exit 0
    r = subprocess.run([sys.executable, "-m", "app"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0
    assert "desktop app is not built yet" in r.stderr
    assert "mtpchat chat" in r.stderr and "mtpchat serve" in r.stderr


def test_commands_keep_compiled_steps_in_the_user_cache_folder(monkeypatch, tmp_path, capsys):
    # inductor's default cache folder is in the temp directory, which many systems empty at boot (a cold
    # compile of the demo model's steps: minutes); commands use the user cache folder unless
    # TORCHINDUCTOR_CACHE_DIR is set
    from app.cli import main
    from engine.resources import compile_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compile_cache_dir())
    if sys.platform == "linux":
        assert compile_cache_dir() == tmp_path / "mtpchat" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    # no writable folder on the way (a read-only home): inductor's default stays
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
