import subprocess
import sys


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
