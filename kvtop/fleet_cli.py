"""List the instances of a running router, or add, cordon, drain, uncordon and remove one while
traffic flows.

  kvtop fleet list                    each instance's fleet state, requests in flight, sessions homed
  kvtop fleet add i4=http://h:8000@kv=tcp://h:5557    a new instance, in `kvtop route --backend` syntax
  kvtop fleet add i5=http://h:8001@kv=auto            ... following the KV events it announces
  kvtop fleet cordon i1               no new sessions on i1; its sessions keep coming
  kvtop fleet drain i1 --wait 300     no new requests on i1; wait until its in-flight ones are done
  kvtop fleet remove i1               out of the fleet (once drained: nothing in flight there)
  kvtop fleet uncordon i1             back in rotation

The router and its control token are found as `kvtop attach` finds them (--router, else the
newest router-<port>.json in the state dir; the token from --token-file, $KVTOP_CONTROL_TOKEN or
the locator). Each change is audited in the router's config_events (docs/control-api.md, "Fleet").
"""

from __future__ import annotations

import argparse
import getpass
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from store.errors import CliError

ACTIONS = ("list", "add", "cordon", "drain", "uncordon", "remove")
POLL_S = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS, help="list the fleet, or change one instance")
    p.add_argument("instance", nargs="?", help="the instance's name, as `kvtop fleet list` shows it; for "
                                               "add, the new one as `kvtop route --backend` takes it")
    p.add_argument("--router", default=None, metavar="URL",
                   help="the router (default: the newest router-<port>.json in the state dir, "
                        "else http://127.0.0.1:8000)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="file holding the control bearer token (default: $KVTOP_CONTROL_TOKEN, "
                        "else the locator's token file)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where routers write router-<port>.json (default ~/.local/state/kvtop)")
    p.add_argument("--force", action="store_true",
                   help="cordon, drain or remove even the last active instance (new sessions are then refused)")
    p.add_argument("--wait", type=float, default=None, metavar="S",
                   help="drain only: wait up to S s until nothing is in flight on the instance; "
                        "exit 1 if it is not drained by then")
    p.add_argument("--json", action="store_true", help="print the router's answer as JSON")


def run(args: argparse.Namespace) -> int:
    from kvtop.tui.feed import ControlError, fetch_json, resolve_target

    if args.action == "list":
        if args.instance is not None:
            raise CliError("`kvtop fleet list` takes no instance")
    elif not args.instance:
        raise CliError("`kvtop fleet add` needs a backend: [NAME=]URL[@kv=tcp://HOST:PORT][@gpu=N]"
                       if args.action == "add" else
                       f"`kvtop fleet {args.action}` needs an instance name (see `kvtop fleet list`)")
    if args.wait is not None and (args.action != "drain" or not args.wait > 0):
        raise CliError("--wait S goes with drain, and S must be positive")
    try:
        target = resolve_target(args.router, token_file=args.token_file, state_dir=args.state_dir)
        if args.action == "list":
            listing = fetch_json(target.url, "/fleet")
            print(json.dumps(listing, indent=2) if args.json else format_listing(listing))
            return 0
        if not target.token:
            raise CliError(f"no control token for {target.url}: pass --token-file or set $KVTOP_CONTROL_TOKEN")
        if args.action == "add":
            out = _post(target.url, "/fleet", {"backend": args.instance}, target.token)
        else:
            body = {"force": True} if args.force else None
            out = _post(target.url, f"/fleet/{urllib.parse.quote(args.instance, safe='')}/{args.action}",
                        body, target.token)
        print(json.dumps(out, indent=2) if args.json else format_change(out))
        if args.wait is None:
            return 0
        deadline = time.monotonic() + args.wait
        while True:
            row = next(i for i in fetch_json(target.url, "/fleet")["instances"] if i["name"] == args.instance)
            drain = row.get("drain")
            if drain is None:
                raise CliError(f"{args.instance} is {row['fleet_state']} now, no longer draining")
            if drain["drained"]:
                print(f"{args.instance}: drained ({drain['sessions_homed']} sessions still homed there "
                      "move at their next turn)")
                return 0
            if time.monotonic() >= deadline:
                print(f"{args.instance}: not drained after {args.wait:g} s "
                      f"({drain['in_flight']} requests in flight)")
                return 1
            time.sleep(POLL_S)
    except ControlError as exc:
        raise CliError(exc.message) from None


def _post(url: str, path: str, body: Any, token: str, timeout: float = 10.0) -> Any:
    """POST to the control API as this user (the audit's ``who``); the router's own message on error."""
    from kvtop.tui.feed import PREFIX, ControlError, _router_message

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + PREFIX + path, data=data, method="POST")
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("X-Kvtop-User", f"kvtop-fleet:{_user()}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ControlError(_router_message(exc.read(), exc.code), exc.code) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(getattr(exc, "reason", None), "strerror", None) or getattr(exc, "reason", exc)
        raise ControlError(f"cannot reach the router at {url}: {reason}") from None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (a container without passwd entry)
        return "unknown"


def format_change(out: dict[str, Any]) -> str:
    if out["action"] == "add":
        return f"{out['instance']}: added, {out['after']}"
    line = f"{out['instance']}: {out['before']} -> {out['after']}"
    if not out["changed"]:
        line += " (no change)"
    drain = out.get("drain")
    if drain is not None:
        line += f"; in flight: {drain['in_flight']}, sessions homed: {drain['sessions_homed']}"
    return line


def format_listing(listing: dict[str, Any]) -> str:
    rows = [("INSTANCE", "STATE", "HEALTHY", "IN FLIGHT", "SESSIONS", "URL")]
    for i in listing["instances"]:
        state = i["fleet_state"]
        if i.get("drain") and i["drain"]["drained"]:
            state += " (drained)"
        rows.append((i["name"], state, "yes" if i["healthy"] else "NO", str(i["num_requests"]),
                     str(i["sessions_homed"]), i["url"]))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
