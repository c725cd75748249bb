"""Hypothesis over the offline tools' input files (issue 36): a sweep spec and a simulated
engine's profile, each a valid file with one or two values replaced by junk of every TOML
type. Whatever the file says, ``kvtop sweep --dry-run`` and ``kvtop sim --profile`` answer
with their plan or with one line and exit 2: never a traceback, and never unbounded work."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvtop.cli import main as kvtop_main

SAMPLE = Path(__file__).resolve().parent.parent / "kvtop" / "data" / "sample_trace.jsonl.gz"
#: Examples per test: small for CI's time; KVTOP_FUZZ_FILE_EXAMPLES raises it for a long run.
EXAMPLES = int(os.environ.get("KVTOP_FUZZ_FILE_EXAMPLES", 60))


# -- a TOML writer for the values hypothesis draws (inline tables, arrays, every scalar) -------
def _key(k: str) -> str:
    out = []
    for ch in k:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return _key(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{ " + ", ".join(f"{_key(k)} = {toml_value(x)}" for k, x in v.items()) + " }"


_text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)
scalar = st.one_of(st.integers(min_value=-2**63, max_value=2**63 - 1), st.floats(), st.booleans(), _text,
                   st.sampled_from([0, -1, 1, 10**18, 1e300, 0.5, "h20", "lmetric", "open", "closed", ""]))
junk = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(_text, inner, max_size=3)), max_leaves=8)


def _document(tables: dict) -> str:
    """Top-level scalars first, then tables; a list of tables stays an inline array."""
    lines = [f"{_key(k)} = {toml_value(v)}" for k, v in tables.items() if not isinstance(v, dict)]
    for k, v in tables.items():
        if isinstance(v, dict):
            lines.append(f"[{_key(k)}]")
            lines += [f"{_key(kk)} = {toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def _mutated(base: dict, draw) -> dict:
    """``base`` with one or two values (top-level or one level down) replaced or added."""
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for _ in range(draw(st.integers(1, 2))):
        key = draw(st.sampled_from(sorted(doc) + ["extra"]))
        if isinstance(doc.get(key), dict) and doc[key] and draw(st.booleans()):
            sub = draw(st.sampled_from(sorted(doc[key]) + ["extra"]))
            doc[key][sub] = draw(junk)
        else:
            doc[key] = draw(junk)
    return doc


def _one_line_or_plan(capsys, argv: list[str]) -> None:
    rc = kvtop_main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, (argv, err[-2000:])
    if rc == 2:
        assert len(err.strip().splitlines()) == 1, err
    else:
        assert rc == 0, (rc, err[-500:])


# -- sweep specs -----------------------------------------------------------------------------
SWEEP = {"repeats": 2, "metric": "ttft_p90_ms", "jitter": 2.0, "profile": "h20", "mode": "open",
         "loads": {"instances": [2], "rate_scale": [1.0]},
         "traces": {"train": [str(SAMPLE)], "validate": [{"path": str(SAMPLE), "name": "v"}]},
         "knobs": {}, "policies": [{"name": "lmetric"}, {"name": "unified", "grid": {"overload_factor": [1.5, 2.0]}}]}


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_sweep_specs_get_a_plan_or_one_line(tmp_path_factory, capsys, data):
    doc = _mutated(SWEEP, data.draw)
    path = tmp_path_factory.mktemp("spec") / "spec.toml"
    path.write_text(_document(doc))
    _one_line_or_plan(capsys, ["sweep", str(path), "--dry-run", "--db", "none"])


def test_the_unmutated_sweep_spec_plans(tmp_path, capsys):
    path = tmp_path / "spec.toml"
    path.write_text(_document(SWEEP))
    assert kvtop_main(["sweep", str(path), "--dry-run", "--db", "none"]) == 0
    assert "lmetric" in capsys.readouterr().out


@pytest.mark.parametrize("profile", [{"a": 1}, ["h20"], "x" * 5000, "a\u0000b", 7],
                         ids=["table", "list", "long", "nul", "int"])
def test_a_sweep_spec_whose_profile_is_not_a_name_gets_one_line(tmp_path, capsys, profile):
    """Found by the fuzz above at 1,500 examples: a table as the profile was read as a path
    and `File name too long` (OSError) ended in a traceback."""
    path = tmp_path / "spec.toml"
    path.write_text(_document({**SWEEP, "profile": profile}))
    assert kvtop_main(["sweep", str(path), "--dry-run", "--db", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "profile" in err and len(err) < 600, err


# -- engine profiles ---------------------------------------------------------------------------
PROFILE = {"format": 1, "base": "h20",
           "profile": {"num_gpu_blocks": 4000, "max_num_batched_tokens": 8192, "max_num_seqs": 64,
                       "block_size": 16, "max_model_len": 32768}}


def _load_profile(path: Path):
    """What ``kvtop sim --profile PATH`` does before it serves: the profile or one line."""
    from kvtop.sim.profiles import ProfileError, get_profile

    try:
        return get_profile(path), None
    except ProfileError as exc:
        return None, str(exc.args[0])


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_profiles_load_or_get_one_line(tmp_path_factory, data):
    from kvtop.sim.engine import Engine
    from kvtop.sim.profiles import check_profile

    doc = _mutated(PROFILE, data.draw)
    path = tmp_path_factory.mktemp("profile") / "p.toml"
    path.write_text(_document(doc))
    profile, err = _load_profile(path)
    if profile is None:
        assert err and len(err.splitlines()) == 1, err
        return
    assert check_profile(profile) is None
    Engine(profile)  # what the server builds first: bounded by the checks (no MemoryError)


def test_the_unmutated_profile_loads(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(_document(PROFILE))
    profile, err = _load_profile(path)
    assert err is None and profile.num_gpu_blocks == 4000


@pytest.mark.parametrize("text", ["x = " + "[" * 3000 + "]" * 3000, "\x00\x01", "[profile]\n[profile]\n"])
def test_unreadable_profiles_get_one_line(tmp_path, text):
    path = tmp_path / "p.toml"
    path.write_text(text)
    profile, err = _load_profile(path)
    assert profile is None and len(err.splitlines()) == 1
