"""``kvtop route --tokenizer auto``: the served model's tokenizer, found where the engine loaded
it or in the Hugging Face cache layout, and said; nothing found is a warning, not a failure."""

from __future__ import annotations

import logging
import os

from aiohttp import web

from router.cli import resolve_tokenizer
from router.state import Backend, RouterConfig
from router.tokenizer_find import find_tokenizer


def _tok(d):
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text("{}")
    return d


def _cache(root, name, revs=("abc",), main="abc"):
    repo = root / ("models--" + name.replace("/", "--"))
    for r in revs:
        _tok(repo / "snapshots" / r)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(main)
    return repo


def test_the_hub_cache_snapshot_refs_main_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = _cache(tmp_path / "hub", "Qwen/Qwen3-30B-A3B", revs=("old", "new"), main="old")
    got = find_tokenizer([{"id": "Qwen/Qwen3-30B-A3B"}])
    assert got is not None and got[0] == str(repo / "snapshots" / "old") and "cache" in got[1]


def test_the_directory_the_engine_loaded_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _cache(tmp_path / "hub", "Qwen/Qwen3-30B-A3B")
    local = _tok(tmp_path / "models" / "qwen")
    got = find_tokenizer([{"id": "qwen", "root": str(local)}])
    assert got == (str(local), f"the directory the engine loaded ({local})")


def test_a_given_directory_is_searched_by_model_name(tmp_path):
    d = _tok(tmp_path / "mine" / "Qwen3-30B-A3B")
    assert find_tokenizer([{"id": "Qwen/Qwen3-30B-A3B"}], str(tmp_path / "mine"))[0] == str(d)


def test_nothing_found_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert find_tokenizer([{"id": "org/unknown"}]) is None
    assert find_tokenizer([]) is None


async def test_route_asks_the_backends_and_says_which_it_used(aiohttp_server, tmp_path, monkeypatch, capsys,
                                                               caplog):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = _cache(tmp_path / "hub", "org/model")
    async def models(request):
        return web.json_response({"object": "list",
                                  "data": [{"id": "org/model", "root": "org/model", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app, host="127.0.0.1")
    url = str(server.make_url("")).rstrip("/")
    cfg = RouterConfig(backends=[Backend("i0", url)], tokenizer="auto", db=None)
    await resolve_tokenizer(cfg)
    assert cfg.tokenizer == str(repo / "snapshots" / "abc")
    assert f"kvtop route: tokenizer {cfg.tokenizer}" in capsys.readouterr().out
    missing = RouterConfig(backends=[Backend("i0", url)], tokenizer=str(tmp_path / "nothing-here"), db=None)
    os.makedirs(missing.tokenizer)
    with caplog.at_level(logging.WARNING, logger="kvtop"):
        await resolve_tokenizer(missing)
    assert missing.tokenizer is None and any("no tokenizer found" in r.getMessage() for r in caplog.records)
    given = RouterConfig(backends=[Backend("i0", url)], tokenizer=str(repo / "snapshots" / "abc"), db=None)
    await resolve_tokenizer(given)  # a directory with tokenizer.json is used as it is
    assert given.tokenizer == str(repo / "snapshots" / "abc")
