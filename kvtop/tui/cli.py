"""Live terminal dashboard on a running kvtop router.

URL defaults to the newest live router found in the state dir (router-<port>.json, written by
`kvtop route`), else http://127.0.0.1:8000. The bearer token for policy and knob changes comes
from --token-file, else $KVTOP_CONTROL_TOKEN, else the token file the locator names; without a
token the dashboard is read-only.

  kvtop attach                      # the router on this machine
  kvtop attach http://127.0.0.1:8001 --readonly
  kvtop attach --once               # one plain-text snapshot, for scripts and bug reports

Keys: ? help, p pause, s/r sort, / filter, +/- refresh rate, [/] chart window,
1-5 tabs, ctrl+p command palette (policy switch, knobs, themes). docs/tui.md has the rest.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", default=None, metavar="URL",
                   help="router base URL (default: the state dir's locator, else http://127.0.0.1:8000)")
    p.add_argument("--once", action="store_true", help="print one plain-text snapshot and exit")
    p.add_argument("--readonly", action="store_true", help="hide every control (policy and knob changes)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="file holding the control bearer token (default: $KVTOP_CONTROL_TOKEN, "
                        "else the locator's token file)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where routers write router-<port>.json (default ~/.local/state/kvtop)")
    p.add_argument("--hz", type=float, default=4.0, metavar="HZ",
                   help="screen refresh rate, 0.5-10 (default 4; + and - change it live)")
    p.add_argument("--theme", default=None,
                   help="kvtop-dark (default), kvtop-light, kvtop-cb (colour-blind safe), or any Textual theme")
    p.add_argument("--max-decisions", type=int, default=500, metavar="N",
                   help="decision rows kept on screen (default 500)")


def run(args: argparse.Namespace) -> int:
    from kvtop.cli import CliError
    from kvtop.tui.feed import ControlError, check_token, fetch_json, resolve_target

    if not 0.5 <= args.hz <= 10:
        raise CliError("--hz must be between 0.5 and 10")
    if args.max_decisions < 1:
        raise CliError("--max-decisions must be at least 1")
    if args.theme is not None:
        # checked before connecting: an unknown name would otherwise be a Textual traceback
        from kvtop.tui.app import theme_names

        if args.theme not in theme_names():
            raise CliError(f"unknown theme {args.theme!r}; one of: {', '.join(theme_names())}")
    try:
        target = resolve_target(args.url, token_file=args.token_file, state_dir=args.state_dir)
        snap = fetch_json(target.url, "/state", timeout=5.0)
    except ControlError as exc:
        raise CliError(exc.message) from None
    if not isinstance(snap, dict) or "instances" not in snap:
        raise CliError(f"{target.url} answered /kvtop/v1/state but not like a kvtop router")
    from kvtop.tui.model import clean_snapshot

    clean, problems = clean_snapshot(snap)
    if args.once and (clean is None or problems):
        # A script reading --once must not get n/a where the router sent garbage: refuse, one line.
        raise CliError(f"{target.url} sent a malformed /kvtop/v1/state: {'; '.join(problems[:3])}")
    snap = clean if clean is not None else {}
    if args.once:
        from kvtop.tui.model import render_once

        sys.stdout.write(render_once(snap))
        return 0
    readonly = bool(args.readonly or (snap.get("router") or {}).get("readonly"))
    if target.token and not readonly:
        try:
            why = check_token(target.url, target.token)
        except ControlError as exc:
            raise CliError(exc.message) from None
        if why is not None:
            raise CliError(f"the token from {target.token_source} was refused by {target.url}: {why}")
    if not (sys.stdout.isatty() and sys.stdin.isatty()):
        raise CliError("no terminal to draw the dashboard on; use --once for a plain-text snapshot")
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed

    def token_loader() -> str | None:
        # the same search as at start (flag, env, the locator of this URL), run again on reconnect
        return resolve_target(target.url, token_file=args.token_file, state_dir=args.state_dir).token

    feed = RouterFeed(target.url, target.token, hz=args.hz, token_loader=token_loader)
    app = KvtopApp(feed, url=target.url, readonly=readonly,
                   can_control=bool(target.token), hz=args.hz, theme=args.theme,
                   max_decisions=args.max_decisions)
    app.run()
    return 0
