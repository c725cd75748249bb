"""Exact tokens with --tokenizer: the model's chat template (tools included), pieced tokenization
equal to whole-text tokenization, a returning turn reusing its prefix, and all of it off the
event loop."""

from __future__ import annotations

import importlib.util
import json
import random
import threading
from pathlib import Path

import pytest

from router.request import count_prompt, parse_request, read_body
from router.tokenizer import Tokenizer
from test_messages import claude_code_body
from test_router_e2e import rows, start_router

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_agentic.py"


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_agentic", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE (2,000 tokens) with ChatML specials and a Qwen2.5-style template."""
    return _bench().build_tokenizer(tmp_path_factory.mktemp("tok"), vocab=2000, corpus_bytes=400_000)


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer(str(tok_dir))


def test_template_renders_tools_and_generation_prompt(tok):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read.",
                                                        "parameters": {"type": "object"}}}]}
    text = tok.render(read_body(body, "chat").prompt)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '{"type": "function", "function": {"name": "read_file"' in text  # tojson, as transformers
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    no_tools = parse_request({"messages": body["messages"]}, "chat", tokenizer=tok)
    assert parse_request(body, "chat", tokenizer=tok).input_tokens > no_tools.input_tokens + 20


def test_messages_and_chat_give_the_same_tokens(tok):
    # vLLM turns an Anthropic body into chat messages + tools: both must count alike
    body = claude_code_body(3, stream=False)
    chat = read_body(body, "messages").prompt
    as_chat = {"messages": chat.messages, "tools": chat.tools}
    a = parse_request(body, "messages", tokenizer=tok, block_size=16)
    b = parse_request(as_chat, "chat", tokenizer=tok, block_size=16)
    assert (a.input_tokens, a.blocks, a.token_source) == (b.input_tokens, b.blocks, "tokenizer")
    assert "<tool_call>" in tok.render(chat) and "<tool_response>" in tok.render(chat)


def test_pieces_equal_whole_text_tokenization(tok):
    rng = random.Random(3)
    words = ["def", " f(x):", "\n    return", " x", "  ", "\n\n", "\u00e9t\u00e9", " <tool_call>", '{"a": 1}', "\t"]
    for _ in range(200):
        parts = ["".join(rng.choice(words) for _ in range(rng.randrange(0, 12))) for _ in range(rng.randrange(1, 6))]
        text = "".join(rng.choice(["<|im_start|>", "<|im_end|>\n", "<|im_end|>", ""]) + p for p in parts)
        assert list(tok.ids(text)) == tok.encode(text), repr(text)
        assert list(tok.ids(text, add_special_tokens=True)) == tok.encode(text, add_special_tokens=True)


def test_parallel_and_one_thread_tokenizing_agree(tok_dir):
    # a cold prompt's pieces over PARALLEL_CHARS go to the tokenizer's threads (encode_batch);
    # a returning turn's few, and every piece with parallel off, are tokenized one by one
    from router.tokenizer import PARALLEL_CHARS

    rng = random.Random(5)
    src = "".join(_bench().corpus(400_000))
    parts = [src[k:k + rng.randrange(5_000, 30_000)] for k in range(0, len(src) - 30_000, 9_000)][:12]
    text = "".join(f"<|im_start|>user\n{p}<|im_end|>\n" for p in parts)
    assert len(text) > PARALLEL_CHARS
    many, one = Tokenizer(str(tok_dir)), Tokenizer(str(tok_dir), parallel=False)
    want = many.encode(text)
    assert list(many.ids(text)) == want == list(one.ids(text))
    grown = text + "<|im_start|>assistant\nok<|im_end|>\n"  # then a returning turn: one new piece
    misses = many.misses
    assert list(many.ids(grown)) == many.encode(grown) and many.misses - misses == 1


def test_returning_turn_reuses_pieces_and_blocks(tok):
    prev = None
    for turn in range(1, 6):
        prompt = read_body(claude_code_body(turn), "messages").prompt
        misses = tok.misses
        counted = count_prompt(prompt, 16, tok, prev)
        full = count_prompt(prompt, 16, tok)  # no previous turn: the same blocks
        assert counted.blocks == full.blocks and counted.input_tokens == len(tok.encode(tok.render(prompt)))
        if turn > 2:
            assert tok.misses - misses <= 3  # only the new turn's pieces were tokenized
        prev = counted


def test_next_turn_reuses_the_previous_texts_tokens_exactly(tok):
    # ids_after takes the previous turn's tokens up to a piece start well inside the text the
    # two turns share; the cut falls anywhere, also inside or just before a special token
    rng = random.Random(11)
    words = ["def", " f(x):", "\n    return", " x", "  ", "\n\n", "\u00e9t\u00e9", " <tool_call>", "<|im", "_end|>", "\t"]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>\n"]

    def text(n):
        return "".join(rng.choice(specials + words * 3) for _ in range(n))

    for _ in range(150):
        prev_text = text(rng.randrange(0, 40))
        prev_ids, prev_pieces, _ = tok.ids_after(prev_text)
        assert list(prev_ids) == tok.encode(prev_text)
        for _ in range(3):  # a session's next turns: cut the text somewhere, then grow it
            nxt = prev_text[:rng.randrange(0, len(prev_text) + 1)] + text(rng.randrange(0, 12))
            ids, pieces, common = tok.ids_after(nxt, prev_ids, prev_pieces)
            assert list(ids) == tok.encode(nxt), (prev_text, nxt)
            if common is not None:
                assert 0 < common <= len(ids) and ids[:common] == prev_ids[:common]
            prev_text, prev_ids, prev_pieces = nxt, ids, pieces


def test_returning_turn_tokenizes_only_its_new_text(tok, tok_dir, monkeypatch):
    # the shared prefix is neither cut nor looked up again: only the text after the cut is
    prompt = [read_body(claude_code_body(turn), "messages").prompt for turn in (4, 5)]
    first = count_prompt(prompt[0], 16, tok)
    cut: list[str] = []
    real = Tokenizer._pieced

    def spy(self, text, marks=False):
        cut.append(text)
        return real(self, text, marks)

    monkeypatch.setattr(Tokenizer, "_pieced", spy)
    second = count_prompt(prompt[1], 16, tok, first)
    whole = tok.render(prompt[1])
    assert second.input_tokens == len(tok.encode(whole)) and len(cut) == 1
    assert len(cut[0]) < len(whole) - len(tok.render(prompt[0])) + 200  # the new turn, about
    assert second.blocks == count_prompt(prompt[1], 16, Tokenizer(str(tok_dir))).blocks


async def test_router_tokenizes_off_the_event_loop(router_client, fake_backends, tmp_path, tok_dir, monkeypatch):
    seen: list[str] = []
    real = Tokenizer._pieced  # what every path tokenizes through (ids, ids_after)

    def spy(self, text, marks=False):
        seen.append(threading.current_thread().name)
        return real(self, text, marks)

    monkeypatch.setattr(Tokenizer, "_pieced", spy)
    fakes = await fake_backends(2)
    client, state = await start_router(router_client, [u for _, u in fakes], tmp_path, policy="unified",
                                       tokenizer=str(tok_dir), block_size=16)
    insts = []
    for turn in range(1, 5):
        r = await client.post("/v1/messages", json=claude_code_body(turn))
        assert r.status == 200
        await r.read()
        insts.append(r.headers["X-Kvtop-Instance"])
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello " * 50}]})
    assert r.status == 200
    assert seen and all(name.startswith("kvtop-tokenize") for name in seen), seen
    decisions = rows(state, "decisions")
    assert {d["token_source"] for d in decisions} == {"tokenizer"}
    expected = [len(state.tokenizer.encode(state.tokenizer.render(read_body(claude_code_body(t), "messages").prompt)))
                for t in range(1, 5)]
    assert [d["input_tokens"] for d in decisions[:4]] == expected
    assert len(set(insts[1:])) == 1
    # the session's turn 3 estimated hit covers turn 2's blocks (its prefix, tokenized the same way)
    assert decisions[2]["est_hit_tokens"] >= (expected[1] // 16 - 2) * 16


def test_tokenizer_path_forms(tok_dir, tmp_path):
    # the directory, or its tokenizer.json (the template is found beside it)
    a, b = Tokenizer(str(tok_dir)), Tokenizer(str(tok_dir / "tokenizer.json"))
    assert a.template is not None and b.template is not None
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    c = Tokenizer(str(bare / "tokenizer.json"))  # no template: the text fallback's rendering
    assert c.template is None
    assert parse_request({"messages": [{"role": "user", "content": "hi"}]}, "chat", tokenizer=c).token_source == "tokenizer"
    bad = tmp_path / "badtpl"
    bad.mkdir()
    (bad / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (bad / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer(str(bad))


def test_big_bodies_tokenize_in_the_worker_process_keeping_the_session(tok, tok_dir, monkeypatch):
    # a big prompt's Python work (JSON, template, hashing) holds the GIL: with a tokenizer it runs
    # in the worker process, which keeps the session's previous turn for the next one
    from router import parsing

    monkeypatch.setattr(parsing, "_worker_turns", parsing.OrderedDict())
    body = claude_code_body(3, stream=False)
    body["metadata"] = {"user_id": "user_x_account_y_session_worker-1"}
    raws = []
    for turn in (1, 2):
        raws.append(json.dumps(body).encode())
        body["messages"] = body["messages"] + [{"role": "assistant", "content": f"step {turn}"},
                                               {"role": "user", "content": "go on " * 50}]
    got = [parsing._parse_in_worker(r, "messages", {}, "X-Session-ID", 16, str(tok_dir), None) for r in raws]
    assert len(parsing._worker_turns) == 1  # the session's last turn is kept in the worker
    for r, rr in zip(raws, got):  # the worker's block hashes cross as one array('q')
        want = parse_request(json.loads(r), "messages", tokenizer=tok, block_size=16)
        assert (rr.input_tokens, rr.blocks.tolist(), rr.token_source) == (want.input_tokens, want.blocks, "tokenizer")
    assert got[1].blocks[:len(got[0].blocks) - 1] == got[0].blocks[:-1]
    assert parsing.TOKENIZE_PROCESS_BYTES < parsing.OFFLOAD_BYTES


def test_worker_tokenizes_cold_prompts_on_its_low_priority_thread(tok, tok_dir, monkeypatch):
    # the worker's main thread (normal priority) does a returning turn whole; a cold prompt's
    # tokenizing (over PARALLEL_CHARS of new text) runs on its one low-priority thread
    from router import parsing

    monkeypatch.setattr(parsing, "_worker_turns", parsing.OrderedDict())
    monkeypatch.setattr(parsing, "_worker_tokenizer", {})
    where: list[tuple[str, int]] = []
    real = Tokenizer._encode

    def spy(self, pieces, *, parallel):
        where.append((threading.current_thread().name, sum(map(len, pieces))))
        return real(self, pieces, parallel=parallel)

    monkeypatch.setattr(Tokenizer, "_encode", spy)
    bench = _bench()
    session = bench.Session(3, bench.corpus(400_000), system_chars=90_000)
    raws = []
    for _ in range(2):
        session.grow()
        raws.append(json.dumps(session.body("chat", "cold-then-warm")).encode())
    got = [parsing._parse_in_worker(r, "chat", {}, "X-Session-ID", 16, str(tok_dir), None) for r in raws]
    assert where[0][0].startswith("kvtop-parse-cold") and where[0][1] > 90_000
    assert [w[0] for w in where[1:]] == ["MainThread"] and where[1][1] < 10_000
    for r, rr in zip(raws, got):
        want = parse_request(json.loads(r), "chat", tokenizer=tok, block_size=16)
        assert (rr.input_tokens, rr.blocks.tolist()) == (want.input_tokens, want.blocks)
