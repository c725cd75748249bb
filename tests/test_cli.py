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
