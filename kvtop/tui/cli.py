"""Live terminal dashboard on a running kvtop router.

URL defaults to the newest live router found in the state dir (router-<port>.json, written by
`kvtop route`), else http://127.0.0.1:8000. The bearer token for policy and knob changes comes
from --token-file, else $KVTOP_CONTROL_TOKEN, else the token file the locator names (policy,
knob, shadow and fleet changes need it); without a token the dashboard is read-only.

  kvtop attach                      # the router on this machine
  kvtop attach http://127.0.0.1:8001 --readonly
  kvtop attach --once               # one plain-text snapshot, for scripts and bug reports
  kvtop attach http://127.0.0.1:8001 http://127.0.0.1:8002   # two routers, same instances

Several URLs: routers in front of the same instances. One line per router (policy, req/s,
instances up, control), one instance table (rows matched by backend URL, load summed, an
in-flight share column r1/r2/...), decisions labelled by router. Policy and knob changes act
on the selected router (marked ▶); R selects the next one.

Keys: ? help, p pause, s/r sort, / filter, +/- refresh rate, [/] chart window,
1-5 tabs, z condensed/every instance row (condensed from 64 instances), C columns, Enter an
instance's detail, a decision's receipt or a session's detail (c copies its id), P policy,
k knobs, S shadows (add, remove, promote), c/d/u/x cordon, drain, uncordon or remove the
selected instance (confirmed; needs the token), R next router (several URLs), ctrl+p command
palette (the same, and themes). Disconnected, every figure is greyed with its age ("stale
12s") until the router is back. docs/tui.md has the rest.

Config file: $XDG_CONFIG_HOME/kvtop/attach.toml (default ~/.config/kvtop/attach.toml, or
--config PATH) sets theme, hz, max_decisions, hidden_columns and [keys] (binding id = key,
e.g. kvtop.sort = "o"); flags win over it. A theme picked from the palette and the columns
chosen with C are saved there.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="*", default=None, metavar="URL",
                   help="router base URL (default: the state dir's locator, else http://127.0.0.1:8000); "
                        "several: routers in front of the same instances, shown together")
    p.add_argument("--once", action="store_true", help="print one plain-text snapshot and exit")
    p.add_argument("--readonly", action="store_true", help="hide every control (policy and knob changes)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="file holding the control bearer token (default: $KVTOP_CONTROL_TOKEN, "
                        "else the locator's token file)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where routers write router-<port>.json (default ~/.local/state/kvtop)")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="config file (default $XDG_CONFIG_HOME/kvtop/attach.toml, "
                        "i.e. ~/.config/kvtop/attach.toml); flags win over it")
    p.add_argument("--hz", type=float, default=None, metavar="HZ",
                   help="screen refresh rate, 0.5-10 (default 4; + and - change it live)")
    p.add_argument("--theme", default=None,
                   help="kvtop-dark (default), kvtop-light, kvtop-cb (colour-blind safe), or any Textual theme")
    p.add_argument("--max-decisions", type=int, default=None, metavar="N",
                   help="decision rows kept on screen (default 500)")


def run(args: argparse.Namespace) -> int:
    from kvtop.cli import CliError
    from kvtop.tui.feed import ControlError, check_token, fetch_json, resolve_target

    if args.hz is not None and not 0.5 <= args.hz <= 10:
        raise CliError("--hz must be between 0.5 and 10")
    if args.max_decisions is not None and args.max_decisions < 1:
        raise CliError("--max-decisions must be at least 1")
    if args.theme is not None:
        # checked before connecting: an unknown name would otherwise be a Textual traceback
        from kvtop.tui.app import theme_names

        if args.theme not in theme_names():
            raise CliError(f"unknown theme {args.theme!r}; one of: {', '.join(theme_names())}")
    config_file, config = read_config(args)
    hz, max_decisions, theme = settings(args, config)
    urls = list(args.url or [])
    if len(urls) > 1:
        return run_several(args, urls, hz=hz, max_decisions=max_decisions, theme=theme, config=config,
                           config_file=config_file)
    try:
        target = resolve_target(urls[0] if urls else None, token_file=args.token_file, state_dir=args.state_dir)
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

    feed = RouterFeed(target.url, target.token, hz=hz, token_loader=token_loader)
    app = KvtopApp(feed, url=target.url, readonly=readonly,
                   can_control=bool(target.token), hz=hz, theme=theme,
                   max_decisions=max_decisions, keymap=config.get("keys"), config_file=config_file,
                   hidden_columns=config.get("hidden_columns"))
    app.run()
    return 0


def run_several(args: argparse.Namespace, urls: list[str], *, hz: float, max_decisions: int, theme: str | None,
                config: dict, config_file: Any) -> int:
    """``attach URL URL ...``: several routers in front of the same instances, as one dashboard."""
    from kvtop.cli import CliError
    from kvtop.tui.feed import ControlError, check_token, fetch_json, resolve_target
    from kvtop.tui.model import clean_snapshot, merge_router_snapshots, render_once

    targets, snaps, control = [], [], []
    for k, url in enumerate(urls):
        label = f"r{k + 1}"
        try:
            target = resolve_target(url, token_file=args.token_file, state_dir=args.state_dir)
            snap = fetch_json(target.url, "/state", timeout=5.0)
        except ControlError as exc:
            raise CliError(f"{label}: {exc.message}") from None
        clean, problems = clean_snapshot(snap)
        if clean is None or (args.once and problems):
            raise CliError(f"{label}: {target.url} sent a malformed /kvtop/v1/state: {'; '.join(problems[:3])}")
        readonly = bool(args.readonly or (clean.get("router") or {}).get("readonly"))
        ok = bool(target.token) and not readonly
        if ok and not args.once:
            try:
                why = check_token(target.url, target.token)  # type: ignore[arg-type]
            except ControlError as exc:
                raise CliError(f"{label}: {exc.message}") from None
            if why is not None:
                raise CliError(f"{label}: the token from {target.token_source} was refused by {target.url}: {why}")
        targets.append(target)
        snaps.append((label, clean))
        control.append(ok)
    if args.once:
        merged = merge_router_snapshots(snaps)
        lines = [f"{r['label']} {t.url}  policy {r['policy']}  {float(r['request_rate'] or 0):.2f} req/s  "
                 f"in flight {r['in_flight'] or 0}  {r['healthy_instances']}/{r['instances']} up"
                 + (f"  {r['replicas']}" if r.get("replicas") else "")
                 for r, t in zip(merged["routers"], targets)]
        share = [f"{i['name']}: " + " ".join(f"{lb}={n}" for lb, n in i["routers"].items())
                 for i in merged["instances"]]
        sys.stdout.write("\n".join(lines) + "\n" + render_once(merged) + "in flight by router  "
                         + "  ".join(share) + "\n")
        return 0
    if not (sys.stdout.isatty() and sys.stdin.isatty()):
        raise CliError("no terminal to draw the dashboard on; use --once for a plain-text snapshot")
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import MultiFeed, RouterFeed

    def loader(url: str):
        return lambda: resolve_target(url, token_file=args.token_file, state_dir=args.state_dir).token

    feeds = [RouterFeed(t.url, t.token, hz=hz, token_loader=loader(t.url)) for t in targets]
    app = KvtopApp(MultiFeed(feeds, can_control=control), url=targets[0].url, readonly=bool(args.readonly),
                   hz=hz, theme=theme, max_decisions=max_decisions, keymap=config.get("keys"),
                   config_file=config_file, hidden_columns=config.get("hidden_columns"))
    app.run()
    return 0


def settings(args: argparse.Namespace, config: dict) -> tuple[float, int, str | None]:
    """(hz, max_decisions, theme): flags win over the config file, the file over the defaults."""
    hz = args.hz if args.hz is not None else config.get("hz", 4.0)
    max_decisions = args.max_decisions if args.max_decisions is not None else config.get("max_decisions", 500)
    theme = args.theme if args.theme is not None else config.get("theme")
    return hz, max_decisions, theme


def read_config(args: argparse.Namespace):
    """(path, settings) of the config file; a bad file is a one-line CliError naming file and key."""
    from kvtop.cli import CliError
    from kvtop.tui.app import KvtopApp, theme_names
    from kvtop.tui.config import ConfigError, config_path, load_config

    path = config_path(getattr(args, "config", None))
    ids = {b.id for b in KvtopApp.BINDINGS if getattr(b, "id", None)}
    try:
        return path, load_config(path, required=bool(getattr(args, "config", None)),
                                 binding_ids=ids, themes=theme_names())
    except ConfigError as exc:
        raise CliError(str(exc)) from None
