"""``kvtop attach``'s config file: $XDG_CONFIG_HOME/kvtop/attach.toml (docs/tui.md, "Config file").

  theme = "kvtop-cb"          # written back when you switch theme from the palette
  hz = 2.0                    # refresh rate, 0.5-10
  max_decisions = 1000
  hidden_columns = ["gpu_mem", "trend"]   # the overview's columns left out (C chooses; saved here)
  [keys]                      # binding id = key (the ids are in docs/tui.md, "Keys")
  kvtop.sort = "o"

Flags on the command line win over the file. Read with stdlib ``tomllib``; every problem is one
line naming the file and the key (``ConfigError``, which ``kvtop attach`` turns into exit 2).
"""

from __future__ import annotations

import os
import re
import tempfile
import tomllib
from pathlib import Path
from typing import Any

KEYS = ("theme", "hz", "max_decisions", "hidden_columns", "keys")


class ConfigError(ValueError):
    """A config file that cannot be used: the message is one line naming the file and key."""


def config_path(override: str | None = None) -> Path:
    """``--config`` if given, else $XDG_CONFIG_HOME/kvtop/attach.toml (default ~/.config)."""
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME", "")
    # the XDG spec: a relative value is invalid and is ignored
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "kvtop" / "attach.toml"


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``kvtop.sort = "o"`` under [keys] is a nested table in TOML: back to dotted ids."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def load_config(path: Path, *, required: bool = False, binding_ids: set[str] | None = None,
                themes: list[str] | None = None) -> dict[str, Any]:
    """The file's settings, checked; {} when it does not exist (unless ``required``: --config)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: no such file") from None
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {' '.join(str(exc).split())}") from None
    for key in data:
        if key not in KEYS:
            raise ConfigError(f"{path}: unknown key {key!r}; known: {', '.join(KEYS)}")
    out: dict[str, Any] = {}
    if "theme" in data:
        theme = data["theme"]
        if not isinstance(theme, str):
            raise ConfigError(f"{path}: theme: must be a string")
        if themes is not None and theme not in themes:
            raise ConfigError(f"{path}: theme: unknown theme {theme!r}; one of: {', '.join(themes)}")
        out["theme"] = theme
    if "hz" in data:
        hz = data["hz"]
        if isinstance(hz, bool) or not isinstance(hz, (int, float)) or not 0.5 <= hz <= 10:
            raise ConfigError(f"{path}: hz: must be a number between 0.5 and 10, not {hz!r}")
        out["hz"] = float(hz)
    if "max_decisions" in data:
        n = data["max_decisions"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"{path}: max_decisions: must be an integer of at least 1, not {n!r}")
        out["max_decisions"] = n
    if "hidden_columns" in data:
        cols = data["hidden_columns"]
        if not isinstance(cols, list) or not all(isinstance(c, str) for c in cols):
            raise ConfigError(f"{path}: hidden_columns: must be a list of column keys, not {cols!r}")
        out["hidden_columns"] = cols
    if "keys" in data:
        if not isinstance(data["keys"], dict):
            raise ConfigError(f"{path}: keys: must be a table ([keys], binding id = \"key\")")
        keymap = _flatten(data["keys"])
        for bid, key in keymap.items():
            if binding_ids is not None and bid not in binding_ids:
                raise ConfigError(f"{path}: keys.{bid}: unknown binding id; known: {', '.join(sorted(binding_ids))}")
            if not isinstance(key, str) or not key.strip() or any(c.isspace() for c in key):
                raise ConfigError(f"{path}: keys.{bid}: must be a key name such as \"o\" or \"ctrl+o\", not {key!r}")
        out["keys"] = keymap
    return out


_TABLE_LINE = re.compile(r"^\s*\[")


def save_theme(path: Path, theme: str) -> None:
    """Write ``theme = "..."`` into the file (``save_setting``)."""
    save_setting(path, "theme", theme)


def save_setting(path: Path, key: str, value: str | list[str]) -> None:
    """Write ``key = value`` (a string or a list of strings) into the file, keeping every other
    line; atomic (temp + rename).

    Raises OSError (or ConfigError if the edited file would not read back) for the caller to report.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        lines = []
    rendered = _toml_string(value) if isinstance(value, str) else "[" + ", ".join(map(_toml_string, value)) + "]"
    new = f"{key} = {rendered}\n"
    key_line = re.compile(rf"^\s*({re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')\s*=")
    for i, line in enumerate(lines):
        if _TABLE_LINE.match(line):
            lines.insert(0, new)  # no top-level line for it: the first line is a top-level key
            break
        if key_line.match(line):
            lines[i] = new
            break
    else:
        lines.insert(0, new)
    text = "".join(lines)
    try:
        if tomllib.loads(text).get(key) != value:
            raise ConfigError(f"{path}: could not place {key} in the file")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {' '.join(str(exc).split())}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".attach-", suffix=".toml", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _toml_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
