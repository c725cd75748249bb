"""The ``kvtop`` verb dispatcher: a verb whose module cannot be imported stays listed and fails loudly."""

from __future__ import annotations

import sys

import pytest

from kvtop import cli


@pytest.fixture
def broken_verbs(monkeypatch, tmp_path):
    """Add three verbs whose modules fail to import in the three ways that happen in practice."""
    (tmp_path / "kvtop_test_missing_dep.py").write_text("import kvtop_test_no_such_dependency\n")
    (tmp_path / "kvtop_test_bad_name.py").write_text("from os import kvtop_test_no_such_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("kvtop_test_missing_dep", "kvtop_test_bad_name"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(cli, "VERBS", cli.VERBS + [
        ("ghost", "kvtop_test_no_such_module", "a verb whose module is gone"),
        ("needy", "kvtop_test_missing_dep", "a verb whose dependency is not installed"),
        ("typo", "kvtop_test_bad_name", "a verb whose module imports a name that does not exist"),
    ])


@pytest.mark.parametrize("argv,module,error", [
    # the module itself is missing: used to vanish, so `kvtop ghost` read as a typo
    (["ghost"], "kvtop_test_no_such_module", "ModuleNotFoundError"),
    # a dependency is missing: used to crash every verb, --help included, with a traceback
    (["needy"], "kvtop_test_missing_dep", "kvtop_test_no_such_dependency"),
    (["typo"], "kvtop_test_bad_name", "ImportError"),
    # arguments, even --help, must not hide the import error behind argparse
    (["ghost", "--help"], "kvtop_test_no_such_module", "ModuleNotFoundError"),
    (["needy", "--turns", "3", "x"], "kvtop_test_missing_dep", "ModuleNotFoundError"),
])
def test_broken_verb_fails_with_one_line_naming_module_and_error(broken_verbs, capsys, argv, module,
                                                                  error):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1, err  # one line, not a traceback or a usage block
    assert err.startswith(f"kvtop {argv[0]}: cannot import {module}")
    assert error in err


def test_help_still_lists_broken_verbs_and_other_verbs_still_work(broken_verbs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps long help lines
    for verb, module in [("ghost", "kvtop_test_no_such_module"), ("needy", "kvtop_test_missing_dep"),
                         ("typo", "kvtop_test_bad_name")]:
        assert verb in out
        assert f"cannot import {module}" in out
    assert "report" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "--help"])  # a healthy verb is untouched by a broken neighbour
    assert exit_info.value.code == 0
    assert "usage: kvtop report" in capsys.readouterr().out


def test_backend_urls_are_checked_and_ipv6_takes_brackets():
    """A backend URL the proxy could not reach is refused at start with one line, and an IPv6
    host is written in brackets, in --backend and in what `kvtop sim` prints."""
    import argparse

    from kvtop.cli import CliError
    from kvtop.sim.cli import route_line, url_host
    from router.cli import parse_backend

    b = parse_backend("http://[::1]:8000@kv=tcp://[::1]:8001", 0)
    assert (b.url, b.kv_events) == ("http://[::1]:8000", "tcp://[::1]:8001")
    for bad in ("http://::1:8000", "http://h:99999", "ftp://h:1", "http://", "h:8000"):
        with pytest.raises(CliError, match="IPv6 address in brackets"):
            parse_backend(bad, 0)
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1" and url_host("[::1]") == "[::1]"
    args = argparse.Namespace(host="::1", port_base=9000, instances=1, kv_events_port_base=None,
                              no_kv_events=False)
    line = route_line(args)
    assert line.startswith("route with: kvtop route --backend http://[::1]:9000@kv=tcp://[::1]:")
    parse_backend(line.split("--backend ")[1].split()[0], 0)  # what the sim prints, the router takes
    assert line.endswith(" --tokenizer kvtop-sim --block-size 16")  # the engine's tokens and blocks
