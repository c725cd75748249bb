"""The ``kvtop`` command: one entry point, one module per verb.

Each verb lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only wires them together, so adding a verb never touches another verb's code.
Heavy imports (Textual, the engine) happen inside ``run``, keeping ``kvtop --help`` fast.
A verb whose module fails to import stays listed; running it prints the import error on one line
and exits 2, and the other verbs keep working.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (verb, module, one-line help). Order is the order ``kvtop --help`` lists them.
VERBS: list[tuple[str, str, str]] = [
    ("demo", "kvtop.demo", "simulated cluster + router + bundled trace + dashboard, one command"),
    ("route", "router.cli", "start the routing proxy in front of vLLM instances"),
    ("attach", "kvtop.tui.cli", "live terminal dashboard on a running router"),
    ("sim", "kvtop.sim.cli", "start N simulated vLLM instances on loopback"),
    ("simulate", "kvtop.simulate", "offline: run a trace through policies in virtual time"),
    ("sweep", "kvtop.sweep", "offline: policies x knob grids x traces x loads, train/validate split"),
    ("replay", "kvtop.replay", "replay a trace against a router or instance over HTTP"),
    ("report", "kvtop.report", "the seed table and per-class TTFT from results or a database"),
    ("trace", "kvtop.traces.cli", "convert, build, cap and describe traces"),
    ("log", "kvtop.log_cli", "query the decision log after a run"),
    ("fleet", "kvtop.fleet_cli", "list, cordon, drain or uncordon a running router's instances"),
]


from store.errors import CliError  # noqa: E402  (the one user-facing error, shared by every layer)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``only``) just that verb's: running a verb imports its module
    alone, so ``kvtop demo`` draws its first frame without importing the router's server first."""
    parser = argparse.ArgumentParser(
        prog="kvtop",
        description="kvtop: KV-cache-aware routing for agentic LLM traffic across vLLM instances.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, module_name, help_text in VERBS:
        if only is not None and verb != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            # A broken verb stays listed and says why when run, instead of vanishing
            # (a missing verb looks like a typo) or taking every other verb down with it.
            _add_broken_verb(sub, verb, module_name, help_text, exc)
            continue
        p = sub.add_parser(verb, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _add_broken_verb(sub, verb: str, module_name: str, help_text: str, exc: Exception) -> None:
    """List ``verb`` with its import error; running it (any arguments, even --help) fails."""
    reason = f"cannot import {module_name}: {type(exc).__name__}: {' '.join(str(exc).split())}"
    # No option prefix and a catch-all positional: whatever follows the verb reaches _run,
    # so `kvtop VERB --help` reports the import error rather than an empty usage line.
    p = sub.add_parser(verb, help=f"{help_text} [unavailable: cannot import {module_name}]",
                       add_help=False, prefix_chars="\0")
    p.add_argument("_ignored", nargs=argparse.REMAINDER)

    def run(_args: argparse.Namespace) -> int:
        raise CliError(reason)

    p.set_defaults(_run=run)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvtop")
    except Exception:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    verb = args_in[0] if args_in and any(args_in[0] == v for v, _, _ in VERBS) else None
    parser = build_parser(only=verb)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except CliError as exc:
        print(f"kvtop {args.verb}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run through the imported module so its CliError is the one verb modules raise.
    from kvtop.cli import main as _main

    sys.exit(_main())
