"""Issue 35's leftovers: the "connecting" first frame comes before the heavy imports, shadow
agreement counts start again at a policy switch, receipts print figures in one precision."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


# -- the first frame -------------------------------------------------------------------------------

def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return set(out.stdout.split())


def test_running_a_verb_imports_that_verbs_module_only():
    """kvtop demo's first frame waited for every verb's module (the router's server, aiohttp:
    0.45 s of CPU, seconds on a loaded host) before demo ran at all."""
    mods = _modules_after("from kvtop.cli import main\nassert main(['demo', '--instances', '0']) == 2")
    assert "kvtop.demo" in mods
    assert not {"router.app", "router.cli", "aiohttp", "textual", "kvtop.simulate"} & mods


def test_kvtop_help_still_lists_every_verb(capsys):
    from kvtop.cli import VERBS, main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(verb in out for verb, _, _ in VERBS)


def test_the_connecting_frame_is_written_before_textual_is_imported():
    import pty

    code = ("import os, sys\nfrom kvtop.tui import splash\nfd = int(sys.argv[1])\n"
            "f = os.fdopen(fd, 'w', encoding='utf-8')\n"
            "assert splash.connecting_frame('http://127.0.0.1:9', 'starting 4 instances', out=f)\n"
            "assert 'textual' not in sys.modules and 'rich' not in sys.modules\n")
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(follower)], pass_fds=(follower,), timeout=60,
                              env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        written = os.read(leader, 4096).decode()
    finally:
        os.close(leader)
        os.close(follower)
    assert written.startswith("\x1b[?1049h")  # the alternate screen Textual then draws over
    assert "⋯ connecting   http://127.0.0.1:9   starting 4 instances" in written


def test_no_frame_when_the_output_is_not_a_terminal(tmp_path):
    from kvtop.tui import splash

    with open(tmp_path / "out", "w") as f:
        assert not splash.connecting_frame("http://x", out=f)
    assert (tmp_path / "out").read_text() == ""
