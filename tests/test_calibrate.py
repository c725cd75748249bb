"""kvtop sim calibrate: the fit recovers a known engine, end to end against kvtop sim itself,
and the profile file it writes round-trips through every verb that takes --profile."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from kvtop.sim import calibrate as cal
from kvtop.sim.engine import Engine
from kvtop.sim.profiles import get_profile, load_profile_file, profile_to_toml
from kvtop.sim.server import SimInstance, create_app

# Every coefficient non-zero, so a fit that drops or mixes up a term cannot pass.
TRUE = replace(get_profile("cpu-tiny"), name="truth", t_fixed=2.1e-3, t_req=1.5e-4,
               t_new_req=1.2e-3, b=22e-6, c=3e-10, kappa=1.9e-7, frontend_overhead_s=9e-3,
               frontend_s_per_token=5e-7)


def synthetic_figures(profile, plan: cal.Plan, engine_side: bool) -> list[cal.Figure]:
    figs = [cal.Figure("frontend", plan.frontend_tokens)]
    figs += [cal.Figure("cold", n) for n in plan.cold]
    figs += [cal.Figure("repeat", n, cached=n) for n in plan.repeat]
    figs += [cal.Figure("extend", a + b, cached=a) for a, b in plan.extend]
    figs += [cal.Figure("tpot", c, cached=c, batch=b, max_tokens=plan.tpot_tokens)
             for c in plan.tpot_contexts for b in plan.tpot_batches]
    for f in figs:
        f.samples = [cal.predict(profile, cal.scenario_features(f, profile, "client"))]
        if engine_side:
            f.engine_samples = [cal.predict(profile, cal.scenario_features(f, profile, "engine"))]
    return figs


@pytest.mark.parametrize("engine_side", [
    True,    # vLLM and kvtop sim: step terms from the engine's histograms, then the frontend
    False,   # a server without them: everything from client timings at once
])
def test_fit_recovers_the_engines_own_coefficients(engine_side):
    # Figures made by the engine model itself must give back the model, or the fit's picture
    # of a scenario (chunks, batch, attention, KV reads) is not what the engine does.
    figs = synthetic_figures(TRUE, cal.Plan(), engine_side)
    prior = replace(get_profile("cpu-tiny"), t_new_req=0.0)
    result = cal.fit(figs, prior)
    got = dict(result.coefficients)
    want = {name: getattr(TRUE, name) for name in cal.COEFFICIENTS}
    if not engine_side:
        # client TTFTs pay one frontend and one admission each: only their sum is seen, and
        # the admission cost stays the prior's (here 0)
        assert got.pop("t_new_req") == prior.t_new_req == 0
        want["frontend_overhead_s"] += want.pop("t_new_req")
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-6), name
    assert result.rms_rel < 1e-9


def test_fit_with_a_weight_bound_prior_keeps_the_weight_read_floor():
    # A GPU prior (h100): small steps cost the weight read W(N)/bw, not b*N; the fit must
    # linearise around that floor instead of inflating t_fixed.
    truth = replace(get_profile("h100"), t_fixed=3.5e-3, t_req=2e-5, b=40e-6, c=8e-10,
                    kappa=30e-9, frontend_overhead_s=4e-3, frontend_s_per_token=2e-7)
    plan = cal.Plan(cold=(1024, 8192, 16384, 32768), repeat=(8192, 32768),
                    extend=((8192, 4096),), tpot_contexts=(256, 8192))
    figs = synthetic_figures(truth, plan, engine_side=True)
    result = cal.fit(figs, replace(get_profile("h100"), b=30e-6))
    assert result.rms_rel < 1e-6
    for name in ("t_fixed", "b", "c", "kappa", "frontend_overhead_s"):
        assert result.coefficients[name] == pytest.approx(getattr(truth, name), rel=1e-3), name


def test_nnls_pins_a_negative_coefficient_at_zero():
    # y = 2*x0 exactly, with a useless column that least squares would make negative
    rows = [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]
    ys = [1.9, 4.0, 6.1]   # unconstrained: x1 = -0.2 < 0
    x = cal._nnls(rows, ys)
    assert x[1] == 0.0 and x[0] == pytest.approx(sum(r[0] * y for r, y in zip(rows, ys)) / 14)


@pytest.mark.parametrize("times, disturbed", [
    ([0.010, 0.012, 0.014, 0.016], False),          # one token per engine step
    ([0.030, 0.030001], True),                      # first two together: TTFT is late
    ([0.01] + [0.02 + 1e-6 * k for k in range(9)], True),   # a backlog read at once
    ([0.01, 0.012, 0.014, 0.014 + 1e-6, 0.016, 0.018, 0.020, 0.022, 0.024, 0.026, 0.028,
      0.030], False),                               # one bunched gap in eleven: kept
])
def test_bunched_tokens_mark_a_sample_disturbed(times, disturbed):
    t = cal.StreamTiming(ttft=times[0], e2e=times[-1], first_token=times[0],
                         last_token=times[-1], output_tokens=len(times), prompt_tokens=10,
                         cached_tokens=0, events=len(times), event_times=times)
    assert t.disturbed is disturbed


def test_tpot_is_timed_from_a_quarter_into_the_answer():
    # a late first event (the whole first quarter arrives at once) must not shrink TPOT
    n = 17
    times = [0.050] * 5 + [0.050 + 0.002 * k for k in range(1, n - 4)]
    t = cal.StreamTiming(ttft=0.05, e2e=times[-1], first_token=times[0], last_token=times[-1],
                         output_tokens=n, prompt_tokens=10, cached_tokens=0, events=n,
                         event_times=times)
    assert cal.tpot_skip(n) == 4
    assert t.tpot == pytest.approx(0.002)


PLAN = cal.Plan(cold=(128, 1024, 2048, 4096), repeat=(2048, 4096), extend=((1024, 1024),),
                tpot_batches=(1, 4), tpot_contexts=(256, 2048), tpot_tokens=32, repeats=1,
                retries=0)


async def test_calibrate_against_kvtop_sim_recovers_its_profile(aiohttp_server, tmp_path):
    # The simulated server exposes vLLM's engine-side histograms with vLLM's meaning, and its
    # engine clock is the model itself: the step terms must come back closely (not exactly:
    # the batch's streams reach the server a few hundred microseconds apart, so the first
    # decode steps are not all full, as with a real vLLM).
    inst = SimInstance(Engine(TRUE), model="truth-model")
    server = await aiohttp_server(create_app(inst))
    url = f"http://127.0.0.1:{server.port}"
    done = []
    profile, result, measured = await cal.calibrate(
        url, base="cpu-tiny", plan=PLAN,
        progress_factory=lambda total: _Progress(total, done))
    assert measured["fit"]["method"].startswith("steps from engine-side figures")
    for name, rel in (("t_fixed", 0.05), ("t_new_req", 0.05), ("b", 0.05), ("c", 0.05),
                      ("kappa", 0.1)):
        assert getattr(profile, name) == pytest.approx(getattr(TRUE, name), rel=rel), name
    # client side: the sim's own HTTP adds a little to its modelled frontend
    assert TRUE.frontend_overhead_s <= profile.frontend_overhead_s < TRUE.frontend_overhead_s + 5e-3
    assert profile.model == "truth-model" and profile.block_size == TRUE.block_size
    assert sum(done) == PLAN.total_requests()
    # the file records where and when, and reads back as the same engine model
    path = tmp_path / "cal.toml"
    cal.write_profile(path, profile, measured["base"], measured)
    back = get_profile(str(path))
    assert back == profile and back.source == str(path)
    assert back.measured["url"] == url and back.measured["at"] and back.measured["figures"]
    # a steady engine: the reference figure re-timed at the end agrees with its first timing
    assert measured["drift"]["figure"] == "cold 1024"
    assert measured["drift"]["ratio"] == pytest.approx(1.0, abs=0.05)
    assert back.measured["drift"] == measured["drift"]


async def test_an_engine_that_slows_down_while_measured_is_reported(aiohttp_server):
    # The host gets busy half-way through: every step takes 1.6x longer from the decode
    # figures on. The fit cannot tell; the drift check must, and say so.
    inst = SimInstance(Engine(TRUE), model="truth-model")
    server = await aiohttp_server(create_app(inst))
    slow = replace(TRUE, **{k: getattr(TRUE, k) * 1.6 for k in ("t_fixed", "t_req", "t_new_req",
                                                                  "b", "c", "kappa")})

    class Slowing(_Progress):
        def __enter__(self):
            def advance(what, n):
                if what.startswith("TPOT"):
                    inst.engine.profile = slow
                self.done.append(n)
            return advance

    lines: list[str] = []
    _, _, measured = await cal.calibrate(
        f"http://127.0.0.1:{server.port}", base="cpu-tiny", plan=PLAN,
        progress_factory=lambda total: Slowing(total, []), log=lines.append)
    assert measured["drift"]["ratio"] > 1 + cal.DRIFT_WARN
    warning = [line for line in lines if line.startswith("warning: the engine's speed moved")]
    assert len(warning) == 1 and "cold 1024" in warning[0] and "quiet" in warning[0]
    assert not any(line.startswith("speed check") for line in lines)


class _Progress:
    def __init__(self, total, done):
        self.total, self.done = total, done

    def __enter__(self):
        return lambda what, n: self.done.append(n)

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- the file through the verbs

@pytest.fixture
def profile_file(tmp_path):
    p = replace(TRUE, name="from-a-file", max_model_len=8192)
    path = tmp_path / "mine.toml"
    path.write_text(profile_to_toml(p, base="cpu-tiny", measured={"url": "http://x", "at": "t"}))
    return path


def test_profile_file_round_trips_every_builtin(tmp_path):
    for name in ("h20", "h100", "cpu-tiny", "cpu-tiny-avx2"):
        path = tmp_path / f"{name}.toml"
        path.write_text(profile_to_toml(get_profile(name)))
        assert load_profile_file(path) == get_profile(name)


def test_engine_and_simulate_accept_a_profile_file(profile_file):
    e = Engine(str(profile_file))
    assert e.max_model_len == 8192 and e.profile.name == "from-a-file"
    from kvtop import simulate
    import argparse
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args(["trace.jsonl", "--policies", "lmetric", "--profile", str(profile_file)])
    assert get_profile(args.profile).name == "from-a-file"


def test_kvtop_sim_serves_a_profile_file(profile_file):
    from kvtop.sim.fidelity import _free_port
    r = subprocess.run([sys.executable, "-m", "kvtop", "sim", "--profile", str(profile_file),
                        "--port-base", str(_free_port()), "--duration", "0.2"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "profile from-a-file" in r.stdout and "max_model_len 8192" in r.stdout


@pytest.mark.parametrize("text, message", [
    ('[profile]\nname = "x"\n', "missing [profile] key(s) model"),
    ('base = "cpu-tiny"\n[profile]\nt_fixed = "fast"\n', "t_fixed must be a float"),
    ('base = "cpu-tiny"\n[profile]\nt_fixd = 0.1\n', "unknown [profile] key(s) t_fixd"),
    ('base = "h30"\n', "base 'h30' is not a built-in profile"),
    ('base = "cpu-tiny"\n[profile]\nblock_size = 0\n', "block_size must be positive"),
    ('base = "cpu-tiny"\n[profile]\nb = -1e-6\n', "b must not be negative"),
    ('format = 9\n', "format 9 is newer"),
    ("[profile\n", "not valid TOML"),
])
def test_a_bad_profile_file_is_a_one_line_key_error(tmp_path, text, message):
    # kvtop simulate (and any verb) catches KeyError and prints exc.args[0]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(KeyError) as exc:
        get_profile(str(path))
    assert message in exc.value.args[0] and "\n" not in exc.value.args[0].strip()


def test_unknown_name_and_missing_file_say_what_is_known(tmp_path):
    with pytest.raises(KeyError, match="known: h20"):
        get_profile("h30")
    with pytest.raises(KeyError, match="does not exist"):
        get_profile(str(tmp_path / "nope.toml"))


def test_a_partial_file_takes_the_rest_from_its_base(tmp_path):
    path = tmp_path / "tweak.toml"
    path.write_text('base = "h20"\n[profile]\nnum_gpu_blocks = 8000\n')
    p = get_profile(str(path))
    assert p.num_gpu_blocks == 8000 and p.b == get_profile("h20").b and p.name == "tweak"


def test_calibrate_refit_reads_the_recorded_figures(tmp_path):
    figs = synthetic_figures(TRUE, PLAN, engine_side=True)
    result = cal.fit(figs, get_profile("cpu-tiny"))
    measured = {"url": "http://x", "at": "t", "base": "cpu-tiny", "fit": cal.fit_table(result),
                "figures": [f.to_dict() for f in figs]}
    path = tmp_path / "old.toml"
    cal.write_profile(path, replace(TRUE, t_fixed=1.0), "cpu-tiny", measured)
    out = tmp_path / "new.toml"
    r = subprocess.run([sys.executable, "-m", "kvtop", "sim", "calibrate", "--refit", str(path),
                        "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert get_profile(str(out)).t_fixed == pytest.approx(TRUE.t_fixed, rel=1e-3)
