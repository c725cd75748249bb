"""The dashboard's first frame, drawn before Textual is imported.

On a loaded host, importing Python's packages, Textual and kvtop and building the app took
seconds before Textual drew anything, and the terminal stayed blank (issue 35). This module
imports nothing heavy: it switches to the alternate screen, as Textual does, and writes the
header and health lines the dashboard draws while it connects. Textual then draws over it;
if the dashboard never starts, ``leave`` restores the screen.
"""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

ENTER = "\x1b[?1049h\x1b[H\x1b[2J"  # alternate screen, cursor home, clear
LEAVE = "\x1b[?1049l"


def connecting_frame(url: str, note: str = "", out: TextIO | None = None) -> bool:
    """Write the "connecting" frame to ``out`` (the terminal); False (nothing written) when it
    is not a terminal."""
    out = out or sys.stdout
    try:
        if not out.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    cols = max(20, shutil.get_terminal_size((80, 24)).columns)
    header = f" ⋯ connecting   {url}" + (f"   {note}" if note else "")
    lines = [("\x1b[1m", header), ("\x1b[2m", "fleet: waiting for the router's first snapshot")]
    out.write(ENTER + "\r\n".join(f"{style}{text[:cols]}\x1b[0m" for style, text in lines))
    out.flush()
    return True


def leave(out: TextIO | None = None) -> None:
    """Back to the normal screen (the dashboard did not start after ``connecting_frame``)."""
    out = out or sys.stdout
    try:
        out.write(LEAVE)
        out.flush()
    except (OSError, ValueError):
        pass
