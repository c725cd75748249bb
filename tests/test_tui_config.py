"""kvtop attach's config file: $XDG_CONFIG_HOME/kvtop/attach.toml (kvtop/tui/config.py)."""

from __future__ import annotations

import tomllib

import pytest

from test_tui import SIZE, make_app, settle


def parse(argv):
    from kvtop.cli import build_parser

    return build_parser().parse_args(["attach", *argv])


def resolved(argv):
    from kvtop.tui.cli import read_config, settings

    args = parse(argv)
    path, config = read_config(args)
    return path, settings(args, config), config


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvtop" / "attach.toml"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_no_file_means_defaults(xdg):
    path, (hz, n, theme), config = resolved([])
    assert path == xdg and not xdg.exists()
    assert (hz, n, theme, config) == (4.0, 500, None, {})


def test_file_read_and_flags_win(xdg, tmp_path):
    write(xdg, 'theme = "kvtop-cb"\nhz = 2\nmax_decisions = 900\n[keys]\nkvtop.sort = "o"\n'
               '"kvtop.tab.policy" = "ctrl+y"\n')
    path, (hz, n, theme), config = resolved([])
    assert (hz, n, theme) == (2.0, 900, "kvtop-cb")
    assert config["keys"] == {"kvtop.sort": "o", "kvtop.tab.policy": "ctrl+y"}
    # each flag wins over the file, the rest still comes from it
    _, (hz, n, theme), _ = resolved(["--hz", "8", "--theme", "kvtop-light"])
    assert (hz, n, theme) == (8.0, 900, "kvtop-light")
    _, (hz, n, theme), _ = resolved(["--max-decisions", "50"])
    assert (hz, n, theme) == (2.0, 50, "kvtop-cb")
    # --config PATH overrides the XDG location
    other = write(tmp_path / "other.toml", "hz = 1.5\n")
    path, (hz, n, theme), _ = resolved(["--config", str(other)])
    assert path == other and (hz, n, theme) == (1.5, 500, None)


def test_home_default_when_xdg_unset(monkeypatch, tmp_path):
    from kvtop.tui.config import config_path

    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config_path() == tmp_path / ".config" / "kvtop" / "attach.toml"


@pytest.mark.parametrize("text, message", [
    ("theme = \n", "not valid TOML"),
    ("hz = 20\n", "hz: must be a number between 0.5 and 10"),
    ('hz = "fast"\n', "hz: must be a number"),
    ("max_decisions = 0\n", "max_decisions: must be an integer of at least 1"),
    ("max_decisions = 2.5\n", "max_decisions: must be an integer"),
    ("theme = 3\n", "theme: must be a string"),
    ('theme = "nope"\n', "theme: unknown theme 'nope'"),
    ("colour = 1\n", "unknown key 'colour'"),
    ('[keys]\nkvtop.nope = "x"\n', "keys.kvtop.nope: unknown binding id"),
    ("[keys]\nkvtop.sort = 1\n", "keys.kvtop.sort: must be a key name"),
    ('keys = "o"\n', "keys: must be a table"),
])
def test_bad_file_is_one_line_exit_2(xdg, capsys, text, message):
    from kvtop.cli import main

    write(xdg, text)
    # port 9 has no router: the file is refused before any network call
    rc = main(["attach", "http://127.0.0.1:9", "--state-dir", "/nonexistent"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"kvtop attach: {xdg}: ") and message in err, err


def test_missing_config_flag_file_is_an_error(tmp_path, capsys):
    from kvtop.cli import main

    rc = main(["attach", "http://127.0.0.1:9", "--config", str(tmp_path / "none.toml")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "none.toml: no such file" in err


def test_help_mentions_config(capsys):
    from kvtop.cli import main

    with pytest.raises(SystemExit):
        main(["attach", "--help"])
    out = capsys.readouterr().out
    assert "--config PATH" in out and "attach.toml" in out


async def test_theme_switch_is_remembered(xdg):
    write(xdg, '# my settings\nhz = 2.0\n\n[keys]\nkvtop.sort = "o"\n')
    app, feed = make_app(steps=3, decisions=0, theme="kvtop-dark", config_file=xdg)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert xdg.read_text().startswith("# my settings")  # nothing written at start
        app.theme = "kvtop-cb"  # what the palette's theme command does
        await pilot.pause()
        data = tomllib.loads(xdg.read_text())
        assert data == {"theme": "kvtop-cb", "hz": 2.0, "keys": {"kvtop": {"sort": "o"}}}
        assert "# my settings" in xdg.read_text()  # the other lines are kept
        app.theme = "kvtop-light"  # the theme line is replaced, not added twice
        await pilot.pause()
        assert xdg.read_text().count("theme =") == 1
        assert tomllib.loads(xdg.read_text())["theme"] == "kvtop-light"
    assert not list(xdg.parent.glob(".attach-*"))  # no temp files left


async def test_theme_from_flag_unchanged_is_not_written(xdg):
    app, feed = make_app(steps=3, decisions=0, theme="kvtop-light", config_file=xdg)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        app.theme = "kvtop-light"
        await pilot.pause()
    assert not xdg.exists()


async def test_theme_creates_dirs_and_failure_notifies_once(tmp_path):
    fresh = tmp_path / "a" / "b" / "attach.toml"
    app, feed = make_app(steps=3, decisions=0, config_file=fresh)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        app.theme = "kvtop-cb"
        await pilot.pause()
    assert tomllib.loads(fresh.read_text()) == {"theme": "kvtop-cb"}

    blocked = tmp_path / "file"
    blocked.write_text("")
    app, feed = make_app(steps=3, decisions=0, config_file=blocked / "kvtop" / "attach.toml")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        for theme in ("kvtop-cb", "kvtop-light", "textual-dark"):
            app.theme = theme
            await pilot.pause()
        notes = [n.message for n in app._notifications if "cannot save the theme" in n.message]
        assert len(notes) == 1
        assert app.is_running and app.theme == "textual-dark"


async def test_remapped_key_from_the_file_works(xdg):
    from kvtop.tui.cli import read_config

    write(xdg, '[keys]\nkvtop.sort = "o"\n')
    _, config = read_config(parse([]))
    app, feed = make_app(steps=5, decisions=0, keymap=config["keys"])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        before = app.sort_key
        await pilot.press("s")  # the old key no longer sorts
        assert app.sort_key == before
        await pilot.press("o")
        assert app.sort_key != before
        assert app.key_names("kvtop.sort", "s") == "o"
