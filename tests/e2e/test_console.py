"""What a run says on the console: DeepSpeed's first op build announced (and cached in the virtualenv, whoever starts
the ranks), a resume named, Ctrl-C as one line with the way back instead of a traceback per rank, no megatron-core
warnings about Transformer Engine/Apex; and the saved config records the run directory actually used."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launcher.rundir import (
    EXTENSIONS_ENV,
    LAUNCHER_ENV,
    SHM_OP,
    default_extensions_dir,
    extensions_root,
    interrupted_line,
    op_build_notice,
    use_extensions_dir,
)
from tests.e2e.test_train import _launch, _overrides

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python, without warning filters or the launcher's marker."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", LAUNCHER_ENV)}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)


def _fake_state(run: Path, step: int) -> Path:
    """A training state as complete as `latest_checkpoint` checks one (meta.json listing a file of its size)."""
    from launcher.state_discovery import TRAINING_FORMAT

    d = run / "checkpoints" / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "trainer.pt").write_bytes(b"x")
    (d / "meta.json").write_text(
        json.dumps({"format": TRAINING_FORMAT, "step": step, "files": {"trainer.pt": 1}})
    )
    (run / "checkpoints" / "latest").write_text(d.name + "\n")
    return d


# ---------------------------------------------------------------------------------------------------------------
# (a) TORCH_EXTENSIONS_DIR and the first build of DeepSpeed's CPU op
# ---------------------------------------------------------------------------------------------------------------


def test_the_extensions_cache_defaults_to_the_virtualenv_and_an_explicit_value_is_kept(monkeypatch, tmp_path):
    from launcher.launch import launch_env
    from launcher.train import prepare_op_cache

    default = default_extensions_dir()
    if sys.prefix == sys.base_prefix:
        assert default is None  # outside a virtualenv: torch's own per-user default
        pytest.skip("the tests do not run in a virtualenv")
    assert default == Path(sys.prefix) / "torch_extensions"
    env: dict[str, str] = {}
    assert use_extensions_dir(env) == str(default) and env == {EXTENSIONS_ENV: str(default)}
    mine = {EXTENSIONS_ENV: str(tmp_path)}
    assert use_extensions_dir(mine) == str(tmp_path) and mine == {EXTENSIONS_ENV: str(tmp_path)}
    # the launcher (for the ranks it starts here) and the trainer (torchrun, srun) apply it
    monkeypatch.delenv(EXTENSIONS_ENV, raising=False)
    assert launch_env(2)[EXTENSIONS_ENV] == str(default)
    assert EXTENSIONS_ENV not in launch_env(2, ranks_run_here=False)  # each node's trainer picks its own
    monkeypatch.setenv("LOCAL_RANK", "1")  # no notice from a second local rank
    prepare_op_cache()
    assert os.environ[EXTENSIONS_ENV] == str(default)
    monkeypatch.setenv(EXTENSIONS_ENV, str(tmp_path))
    assert launch_env(2)[EXTENSIONS_ENV] == str(tmp_path)
    prepare_op_cache()
    assert os.environ[EXTENSIONS_ENV] == str(tmp_path)


def test_the_makefile_exports_the_same_default_and_keeps_a_set_value():
    line = next(
        ln
        for ln in (REPO / "Makefile").read_text().splitlines()
        if ln.startswith("export TORCH_EXTENSIONS_DIR")
    )
    assert line == "export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions", line
    if Path(sys.prefix).resolve() == (REPO / ".venv").resolve():
        assert default_extensions_dir().resolve() == (REPO / ".venv" / "torch_extensions").resolve()


def test_the_build_notice_appears_only_while_the_op_is_not_in_the_cache(monkeypatch, tmp_path, capsys):
    import torch
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    from torch.utils.cpp_extension import _get_build_directory

    from launcher.train import prepare_op_cache

    assert ShareMemCommBuilder.NAME == SHM_OP  # the op DeepSpeed builds for CPU ranks
    cache = tmp_path / "cache"
    monkeypatch.setenv(EXTENSIONS_ENV, str(cache))
    assert Path(_get_build_directory(SHM_OP, False)) == extensions_root() / SHM_OP  # where torch builds it
    note = op_build_notice()
    assert note == f"building DeepSpeed's {SHM_OP} (first launch only, about 100 s; cached in {cache})"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    prepare_op_cache()
    assert capsys.readouterr().err == note + "\n"
    monkeypatch.setenv("LOCAL_RANK", "1")
    prepare_op_cache()
    assert capsys.readouterr().err == ""  # once per node
    (cache / SHM_OP / f"{SHM_OP}.so").write_bytes(b"")  # built: what torch loads without building
    assert op_build_notice() is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    prepare_op_cache()
    assert capsys.readouterr().err == ""
    # unset: torch's per-user default, computed as torch computes it
    monkeypatch.delenv(EXTENSIONS_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    assert Path(_get_build_directory(SHM_OP, False)) == extensions_root() / SHM_OP
    assert str(tmp_path / "home-cache") in op_build_notice()


# ---------------------------------------------------------------------------------------------------------------
# (c) Ctrl-C
# ---------------------------------------------------------------------------------------------------------------


def test_the_interrupt_line_names_the_last_checkpoint_and_how_to_resume(tmp_path):
    run = tmp_path / "run"
    assert "no checkpoint was written in" in interrupted_line(run)
    state = _fake_state(run, 4)
    line = interrupted_line(run)
    assert (
        line.startswith(f"interrupted; the last checkpoint is {state} (step 4)") and "--resume auto" in line
    ), line
    assert "\n" not in line and "nothing was written" in interrupted_line(None)


def test_only_rank_0_of_ranks_started_without_the_launcher_reports_an_interrupt(
    monkeypatch, tmp_path, capsys
):
    from launcher.train import report_interrupt

    _fake_state(tmp_path, 2)
    saved = signal.getsignal(signal.SIGINT)
    try:
        monkeypatch.delenv(LAUNCHER_ENV, raising=False)
        for rank, says in (("0", True), ("1", False)):
            monkeypatch.setenv("RANK", rank)
            assert report_interrupt(tmp_path) == 130
            assert capsys.readouterr().err == (interrupted_line(tmp_path) + "\n" if says else "")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv(LAUNCHER_ENV, "1")  # launcher.launch says it once the ranks have ended
        assert report_interrupt(tmp_path) == 130 and capsys.readouterr().err == ""
    finally:
        signal.signal(signal.SIGINT, saved)


def _interrupt_when(cmd: list[str], ready: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Start `cmd` in its own session, and once `ready` exists send SIGINT to its whole process group (what Ctrl-C in
    a terminal does); returns its exit status and output."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert ready.exists(), f"never got ready (status {proc.poll()})"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_ctrl_c_in_a_trainer_exits_130_with_one_line_and_no_traceback(tiny_tokens, tmp_path):
    """A real SIGINT to a trainer process (`launcher.train.main`, its training replaced by a wait)."""
    run, ready = tmp_path / "run", tmp_path / "ready"
    state = _fake_state(run, 2)
    (tmp_path / "ext" / SHM_OP).mkdir(parents=True)
    (tmp_path / "ext" / SHM_OP / f"{SHM_OP}.so").write_bytes(b"")  # no build notice in this output
    script = f"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the test runs with SIGINT ignored
import launcher.train as t
from data.cli import exit_process

def wait(plan, run_dir, resume):
    open({str(ready)!r}, "w").close()
    time.sleep(120)

t.train = wait
exit_process(t.main(sys.argv[1:]))
"""
    args = ["--run-dir", str(run), *_overrides(tiny_tokens)]
    proc = _interrupt_when(
        [sys.executable, "-c", script, *args], ready, _env(**{EXTENSIONS_ENV: str(tmp_path / "ext")})
    )
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines() == [interrupted_line(run)], proc.stderr
    assert str(state) in proc.stderr


def test_ctrl_c_in_the_launcher_exits_130_with_one_line_once_the_ranks_ended(tmp_path):
    """A real SIGINT to the launcher's process group while DeepSpeed's runner (in the launcher's process) runs a
    "rank" (a shell waiting): the rank is gone when the launcher says where the last checkpoint is."""
    run, ready, rank_pid = tmp_path / "run", tmp_path / "ready", tmp_path / "rank_pid"
    _fake_state(run, 6)
    script = f"""
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from pathlib import Path
from data.cli import exit_process
from launcher.distributed import free_port
from launcher.launch import REPO_ROOT, launch_env, run_and_report

cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--no_local_rank", "--master_port", str(free_port()),
       "--num_gpus", "1", "--no_python", "/bin/sh", "-c", "echo $$ > {rank_pid}; touch {ready}; exec sleep 120"]
exit_process(run_and_report(cmd, launch_env(1), Path({str(run)!r})))
"""
    proc = _interrupt_when([sys.executable, "-c", script], ready, _env())
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert [ln for ln in proc.stderr.splitlines() if "interrupted" in ln] == [interrupted_line(run)], (
        proc.stderr
    )
    assert proc.stderr.strip().splitlines()[-1] == interrupted_line(run)  # the last word, after the runner's
    pid = int(rank_pid.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


# ---------------------------------------------------------------------------------------------------------------
# (d) megatron-core's Transformer Engine/Apex warnings
# ---------------------------------------------------------------------------------------------------------------

_MEGATRON = "Transformer Engine and Apex are not installed"


def test_the_project_imports_megatron_core_without_its_transformer_engine_warnings():
    """The trainer's entry module and every project module that imports megatron-core, in a fresh process: none of
    its Transformer Engine/Apex warnings, while any other warning still shows. The control, in the same process (a
    second megatron-core import costs ~20 s on 2 busy cores): with the project's filter removed, re-running one of
    megatron-core's modules that warns shows the warning."""
    code = f"""
import importlib, sys, warnings
import launcher.train, parallel.tensor_parallel, data.blocks
import megatron.core.datasets.indexed_dataset, megatron.core.optimizer.clip_grads as clip_grads
warnings.warn("another warning", UserWarning)
print("--- control ---", file=sys.stderr, flush=True)
warnings.filters[:] = [f for f in warnings.filters if not (f[1] is not None and f[1].pattern == {_MEGATRON!r})]
importlib.reload(clip_grads)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    project, control = proc.stderr.split("--- control ---")
    assert _MEGATRON not in project and "UserWarning: another warning" in project, project
    assert f"UserWarning: {_MEGATRON}" in control, control


# ---------------------------------------------------------------------------------------------------------------
# (e) the saved config names the run directory; (b) a resume is announced on the launched run's console
# ---------------------------------------------------------------------------------------------------------------


def test_the_saved_config_records_the_run_dir_given(tiny_tokens, tmp_path, monkeypatch):
    from launcher.launch import main

    monkeypatch.chdir(tmp_path)
    sets = [*_overrides(tiny_tokens), "--set", "logging.out_dir=runs/demo/demix"]
    assert main(["--run-dir", "rel/run", "--dry-run", *sets]) == 0
    run = tmp_path / "rel" / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["logging"]["out_dir"] == str(run)
    # the ranks' config too
    assert f"logging.out_dir={json.dumps(str(run))}" in (run / "command.sh").read_text()
    assert not (tmp_path / "runs").exists()
    # without --run-dir the config's own folder is the run directory, and is recorded (absolute)
    assert main(["--dry-run", *sets]) == 0
    default = tmp_path / "runs" / "demo" / "demix"
    assert yaml.safe_load((default / "config.yaml").read_text())["logging"]["out_dir"] == str(default)


def test_a_trainer_started_with_a_run_dir_plans_with_it(tiny_tokens, tmp_path, monkeypatch):
    import launcher.train as t

    seen = {}
    monkeypatch.setattr(
        t, "train", lambda plan, run_dir, resume: seen.update(cfg=plan.cfg, run_dir=run_dir) or {}
    )
    monkeypatch.setattr(t, "prepare_op_cache", lambda: None)
    for k, v in dict(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29555",
    ).items():
        monkeypatch.setenv(k, v)
    assert (
        t.main(
            ["--run-dir", str(tmp_path / "r"), *_overrides(tiny_tokens), "--set", "logging.out_dir=runs/x"]
        )
        == 0
    )
    assert seen["run_dir"] == tmp_path / "r" and seen["cfg"].logging.out_dir == str(tmp_path / "r")


@pytest.mark.long
@pytest.mark.slow
def test_a_launched_resume_is_announced_and_the_run_records_its_run_dir(tiny_tokens, tmp_path):
    """Two launches into one --run-dir: the second says on the console where it resumes from; the config and the
    exported model record the run directory; no megatron-core Transformer Engine/Apex warning reaches the console."""
    run = tmp_path / "run"
    sets = [*_overrides(tiny_tokens, kind="dense", steps=2), "--set", "logging.out_dir=runs/demo/dense"]
    first = _launch(["--nproc", "1", "--run-dir", str(run), *sets])
    assert "resuming from" not in first.stderr and _MEGATRON not in first.stderr + first.stdout
    second = _launch(["--nproc", "1", "--run-dir", str(run), *sets, "--set", "train.steps=3"])
    line = f"resuming from {run / 'checkpoints' / 'step_00000002'} at step 2 (of 3 steps)"
    assert line in second.stderr.splitlines(), second.stderr[-3000:]
    assert _MEGATRON not in second.stderr + second.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["logging"]["out_dir"] == str(run)
    assert json.loads((run / "model" / "meta.json").read_text())["config"]["logging"]["out_dir"] == str(run)
