"""The ranks started by the real programs a cluster uses (Open MPI's mpirun, torchrun, `launch --launcher openmpi`),
each training the tiny run of 2 ranks `launch --nproc 2` trains, to the same losses. Each test skips, saying why,
where its program is not installed (.ci/run installs them: openmpi-bin)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.distributed import free_port
from launcher.metrics import read_metrics
from tests.e2e.test_train import _launch
from tests.harness import slurm

pytestmark = pytest.mark.long  # real cluster programs: make test-long

REPO = Path(__file__).resolve().parents[2]
slurm_cluster = slurm.slurm_cluster  # the fixture (tests/harness/slurm.py)
MPIRUN = shutil.which("mpirun")
OMPI_INFO = shutil.which("ompi_info")  # what DeepSpeed's OpenMPIRunner asks for
TORCHRUN = Path(sys.executable).parent / "torchrun"
NO_OPENMPI = "Open MPI is not installed (no mpirun/ompi_info on PATH; apt-get install openmpi-bin)"
# Open MPI refuses to run as root without them
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
ROOT_FLAG = ["--allow-run-as-root"] if os.geteuid() == 0 else []


def _sets(tokens: Path) -> list[str]:
    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
    ]
    sets += [
        "model.ffn.kind=demix",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        "data.domains=[cooking,finance]",
    ]
    sets += [
        "train.steps=2",
        "train.micro_batch=2",
        "train.grad_accum=2",
        "train.lr=3e-3",
        "train.eval_batches=1",
    ]
    sets += ["parallel.zero_stage=1", "logging.log_interval=1", "logging.wandb_mode=disabled"]
    sets += ["logging.progress_bar=false"]
    return [a for s in sets for a in ("--set", s)]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"}


def _bare_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's rank variables, one thread per rank, the repository importable."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {
        k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("OMPI_", "PMI_", "SLURM_"))
    }
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", **AS_ROOT, **extra)


@pytest.fixture(scope="module")
def launched(tiny_tokens, tmp_path_factory) -> dict[int, float]:
    """The losses of `launch --nproc 2` on the tiny run: what every launcher below must reproduce."""
    run = tmp_path_factory.mktemp("launch_nproc2")
    _launch(["--nproc", "2", "--run-dir", str(run), *_sets(tiny_tokens)])
    losses = _losses(run)
    assert sorted(losses) == [1, 2]
    return losses


def _same_world_and_losses(run: Path, reference: dict[int, float], out: str) -> None:
    starts = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "start"]
    assert [s["world_size"] for s in starts] == [2], out[-3000:]
    got = _losses(run)
    assert sorted(got) == sorted(reference)
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (step, reference, got)


def _run(cmd: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.skipif(MPIRUN is None or OMPI_INFO is None, reason=NO_OPENMPI)
def test_mpirun_ranks_train_as_launch_does(tiny_tokens, tmp_path, launched):
    """`mpirun -n 2 python -m launcher.train`: each rank reads OMPI_COMM_WORLD_* (launcher/distributed.py) and the
    rendezvous from MASTER_ADDR/MASTER_PORT passed with -x."""
    run, port = tmp_path / "mpirun", free_port()
    cmd = [MPIRUN, *ROOT_FLAG, "-n", "2", "--oversubscribe", "--bind-to", "none"]
    cmd += [
        "-x",
        "MASTER_ADDR=127.0.0.1",
        "-x",
        f"MASTER_PORT={port}",
        "-x",
        "OMP_NUM_THREADS",
        "-x",
        "PYTHONPATH",
    ]
    cmd += [sys.executable, "-m", "launcher.train", "--run-dir", str(run), *_sets(tiny_tokens)]
    out = _run(cmd, _bare_env())
    _same_world_and_losses(run, launched, out)


@pytest.mark.slow
@pytest.mark.skipif(MPIRUN is None or OMPI_INFO is None, reason=NO_OPENMPI)
def test_launch_with_openmpi_on_a_one_host_hostfile(tiny_tokens, tmp_path, launched):
    """`launch --hostfile (localhost slots=2) --launcher openmpi --no-ssh-check`: DeepSpeed's OpenMPIRunner runs
    mpirun (the one-host hostfile honours --launcher), which starts launcher/_rank_entry.py on each rank."""
    run = tmp_path / "launch-openmpi"
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    mpi_args = " ".join([*ROOT_FLAG, "--oversubscribe", "--bind-to none", "--mca btl_tcp_if_include lo"])
    proc = _launch(
        ["--hostfile", str(tmp_path / "hostfile"), "--launcher", "openmpi", "--no-ssh-check"]
        + ["--launcher-args", mpi_args, "--run-dir", str(run), *_sets(tiny_tokens)],
        env_extra=AS_ROOT,
    )
    out = proc.stdout + proc.stderr
    assert "--launcher=openmpi" in (run / "command.sh").read_text() and "cmd = mpirun" in out, out[-3000:]
    _same_world_and_losses(run, launched, out)


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.is_file(), reason=f"torchrun is not installed next to {sys.executable}")
def test_torchrun_ranks_train_as_launch_does(tiny_tokens, tmp_path, launched):
    """`torchrun --standalone --nproc-per-node 2 -m launcher.train`: torch's own RANK/WORLD_SIZE/MASTER_*."""
    run = tmp_path / "torchrun"
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "launcher.train"]
    out = _run([*cmd, "--run-dir", str(run), *_sets(tiny_tokens)], _bare_env())
    _same_world_and_losses(run, launched, out)


@pytest.mark.slow
@pytest.mark.skipif(not slurm.HAVE_SLURM, reason=slurm.NO_SLURM)
def test_launch_with_slurm_on_a_one_node_cluster(tiny_tokens, tmp_path, launched, slurm_cluster):
    """`launch --hostfile (localhost slots=2) --launcher slurm` inside the allocation srun makes: DeepSpeed's
    SlurmRunner runs `srun -n 2 python -u launcher/_rank_entry.py ...` (with `--module` it ran a file that does not
    exist), no ssh check; the ranks read SLURM_PROCID/SLURM_STEP_NUM_TASKS."""
    run = tmp_path / "launch-slurm"
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    proc = _launch(
        [
            "--hostfile",
            str(tmp_path / "hostfile"),
            "--launcher",
            "slurm",
            "--launcher-args=--oversubscribe",  # with `=`: argparse takes a lone "--x" for an option
        ]
        + ["--run-dir", str(run), *_sets(tiny_tokens)],
        env_extra=slurm_cluster,
    )
    out = proc.stdout + proc.stderr
    assert "cmd = srun" in out and "_rank_entry.py" in out, out[-3000:]
    _same_world_and_losses(run, launched, out)
