"""The golden loss curves (tests/golden/curves.py): the first steps' losses of a tiny Dense, DEMix and GShard run on
2 gloo ranks equal the stored ones exactly, and the comparison is sharp enough to see a one-ulp change in the init.

Record them again after a deliberate change of the numerics: `python -m tests.golden.record` (docs/testing.md)."""

from __future__ import annotations

import json

import pytest

from tests.golden.curves import (
    KINDS,
    NUDGE,
    RECORD_COMMAND,
    STEPS,
    GoldenMismatch,
    compare,
    load_record,
    make_record,
    other_kernels,
    overrides,
    path_of,
    run_curves,
)

ENV = {"torch": "t", "deepspeed": "d", "cpu": "c", "cpu_capability": "a"}  # any: the message's notes only


@pytest.fixture(scope="module")
def curves(tiny_tokens, tmp_path_factory) -> dict[str, list[float]]:
    """Every architecture's losses, and the dense run's again with `NUDGE` moved by one ulp after init: all in one
    set of 2 ranks (one start-up), each run through the real trainer."""
    runs = [(kind, kind, None) for kind in KINDS] + [("dense-1ulp", "dense", NUDGE)]
    return run_curves(tiny_tokens, tmp_path_factory.mktemp("golden"), runs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_first_steps_losses_equal_the_golden_curve(kind, curves, tiny_tokens):
    reason = other_kernels(load_record(kind)["recorded_with"])
    if reason:
        pytest.skip(reason)
    compare(kind, curves[kind], tokens=tiny_tokens)


def test_only_the_recorded_kernels_are_held_to_the_curves():
    """Exact on the machine kind they were recorded on; skipped, saying why, on another CPU kernel family or vendor
    or another torch/DeepSpeed (AVX-512 sums in another order than AVX2: tests pass on any x86 CPU)."""
    here = {
        "torch": "2.13.0+cpu",
        "deepspeed": "0.19.8",
        "cpu_vendor": "AuthenticAMD",
        "cpu_capability": "AVX2",
    }
    assert other_kernels(here, dict(here, cpu="another model name", python="3.12.1")) is None
    for key, value in (("cpu_capability", "AVX512"), ("cpu_vendor", "GenuineIntel"), ("torch", "2.14.0+cpu")):
        reason = other_kernels(here, dict(here, **{key: value}))
        assert reason is not None and key in reason and RECORD_COMMAND in reason, reason


@pytest.mark.slow
def test_a_one_ulp_change_in_the_init_fails_the_comparison(curves, tiny_tokens):
    """The dense run with one weight element moved by one ulp after `GPT.reset_parameters` (`NUDGE`: element 0 of
    the first block's qkv projection, a weight every token goes through; a 1-ulp move of an element that no token
    reaches, e.g. token 0's embedding row, changes no fp32 loss in 8 steps) fails the comparison that the plain run
    passes. The golden record here is made from this session's own plain run, so the check holds whether or not the
    stored files are current."""
    golden = make_record("dense", curves["dense"], tiny_tokens, env=ENV)
    compare("dense", curves["dense"], golden, env=ENV)
    with pytest.raises(GoldenMismatch) as err:
        compare("dense", curves["dense-1ulp"], golden, env=ENV)
    msg = str(err.value)
    assert "step " in msg and "expected " in msg and ", got " in msg and RECORD_COMMAND in msg, msg
    assert curves["dense-1ulp"] != curves["dense"]


def test_the_stored_curves_are_complete_and_match_this_configuration():
    """Without training: every file holds steps 1..STEPS, hex and decimal agree, and the overrides it was recorded
    with are the ones the test runs (a changed configuration needs a new recording, named here before any run)."""
    for kind in KINDS:
        rec = load_record(kind)
        assert rec["kind"] == kind and rec["steps"] == STEPS == len(rec["losses"]), path_of(kind)
        assert [e["step"] for e in rec["losses"]] == list(range(1, STEPS + 1))
        for e in rec["losses"]:
            assert float.fromhex(e["hex"]) == float(e["decimal"]), (path_of(kind), e)
        assert rec["overrides"] == overrides(kind), (
            f"{path_of(kind)} was recorded with other overrides than tests/golden/curves.py `overrides` gives: "
            f"record again with `{RECORD_COMMAND}`"
        )
        assert rec["record_command"] == RECORD_COMMAND


def test_a_mismatch_names_the_step_the_values_the_versions_and_the_command():
    golden = json.loads(path_of("dense").read_text())
    want = [float.fromhex(e["hex"]) for e in golden["losses"]]
    env = {**golden["recorded_with"], "torch": "9.9.9"}
    compare("dense", want, golden, env=env)  # equal: passes, whatever the versions
    got = list(want)
    got[2] = float.fromhex(golden["losses"][2]["hex"]) + 2**-20
    with pytest.raises(GoldenMismatch) as err:
        compare("dense", got, golden, env=env)
    msg = str(err.value)
    assert "at 1 step(s)" in msg and f"step 3: expected {want[2]!r} ({want[2].hex()}), got {got[2]!r}" in msg
    assert f"recorded with torch {golden['recorded_with']['torch']!r}, running '9.9.9'" in msg
    assert RECORD_COMMAND in msg
    with pytest.raises(GoldenMismatch, match=r"step 8: expected .*, got \(none\)"):
        compare("dense", want[:-1], golden, env=env)
    stale = {**golden, "overrides": golden["overrides"][:-1]}
    with pytest.raises(GoldenMismatch, match="every loss equals the golden curve .* other inputs") as err:
        compare("dense", want, stale, env=env)
    assert "input changed: the run's overrides" in str(err.value) and RECORD_COMMAND in str(err.value)


def test_recording_refuses_to_write_when_two_runs_disagree(monkeypatch, tmp_path):
    """`python -m tests.golden.record` writes nothing unless both runs give the same losses (stand-in runs here)."""
    import launcher.rundir
    import tests.harness.multirank
    from tests.golden import record

    monkeypatch.setattr(launcher.rundir, "use_extensions_dir", lambda: None)
    monkeypatch.setattr(tests.harness.multirank, "start_rank_server", lambda: None)
    monkeypatch.setattr(record, "build_corpus", lambda root: root)
    calls = []

    def runs(tokens, out, runs):
        calls.append(out.name)
        return {label: [10.0, 9.0 + (len(calls) == 2) * 2**-40] for label, _, _ in runs}

    monkeypatch.setattr(record, "run_curves", runs)
    assert record.main(["--out", str(tmp_path)]) == 1
    assert calls == ["first", "second"] and not list(tmp_path.iterdir())
