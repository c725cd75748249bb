"""``kvtop route --tokenizer auto`` (or a directory to search): the tokenizer of the model the
backends serve, found on this machine, so that text prompts can be counted exactly.

Where it looks, for each model the backends name in ``GET /v1/models`` (its ``id`` and, as
vLLM reports it, its ``root``: the path or Hugging Face id the engine loaded):

0. ``kvtop-sim``, when a backend is ``kvtop sim`` (its ``root``): the simulator's own
   tokenizer (router/sim_tokenizer.py), never a real model's of the same name;

1. the ``root`` itself, when it is a local directory holding ``tokenizer.json`` (an engine
   started from a local path names its own files);
2. the Hugging Face hub cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
   ``~/.cache/huggingface/hub``), or the directory given instead of ``auto``:
   ``models--ORG--NAME/snapshots/REV/`` (the revision ``refs/main`` names, else the newest),
   and ``ORG/NAME`` or ``NAME`` directories under a given directory.

``find_tokenizer`` returns the directory and how it was found; nothing found is None (the
router then warns and keeps the approximation).
"""

from __future__ import annotations

import os
from pathlib import Path

from router.sim_tokenizer import NAME as SIM_NAME


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _has_tokenizer(d: Path) -> bool:
    return (d / "tokenizer.json").is_file()


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot of a hub-cache repo directory that holds a tokenizer: refs/main's, else the newest."""
    snaps = repo_dir / "snapshots"
    if not snaps.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        d = snaps / ref.read_text().strip()
        if _has_tokenizer(d):
            return d
    found = [d for d in snaps.iterdir() if d.is_dir() and _has_tokenizer(d)]
    return max(found, key=lambda d: d.stat().st_mtime) if found else None


def find_tokenizer(models: list[dict], search: str | None = None) -> tuple[str, str] | None:
    """(tokenizer directory, how it was found) for the first of ``models`` (``/v1/models``
    entries: ``id`` and maybe ``root``) found; ``search``: a directory to look in instead of
    the hub cache."""
    names: list[str] = []
    for m in models:
        for key in ("root", "id"):
            v = m.get(key) if isinstance(m, dict) else None
            if isinstance(v, str) and v and v not in names:
                names.append(v)
    if SIM_NAME in names:  # 0. kvtop sim names its own tokenizer as its model's root
        return SIM_NAME, "the backends' /v1/models: kvtop sim"
    for name in names:  # 1. the engine's own files
        p = Path(name).expanduser()
        if p.is_absolute() and p.is_dir() and _has_tokenizer(p):
            return str(p), f"the directory the engine loaded ({name})"
    root = Path(search).expanduser() if search else hub_cache()
    for name in names:  # 2. a hub cache, or the given directory
        if Path(name).is_absolute():
            continue
        repo = root / ("models--" + name.replace("/", "--"))
        snap = _snapshot(repo) if repo.is_dir() else None
        if snap is not None:
            return str(snap), f"the Hugging Face cache {root} for model {name}"
        for d in (root / name, root / name.split("/")[-1]):
            if d.is_dir() and _has_tokenizer(d):
                return str(d), f"{d} for model {name}"
    return None
