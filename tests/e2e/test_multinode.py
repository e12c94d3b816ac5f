"""Multi-node launches on one machine: two "nodes" on localhost, started the way a cluster starts them.

`launcher.launch --hostfile H --no-ssh --node-rank k --master-addr A --master-port P` is run once per node (as a
user runs it on each node, or as srun does); DeepSpeed's runner starts that node's ranks. The result must be
the single-node run's, step for step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import ConfigError
from launcher.distributed import free_port
from launcher.launch import build_command, node_resources, parse_args, prepare_run, world_size
from launcher.metrics import read_metrics
from tests.e2e.test_train import reference_run

REPO = Path(__file__).resolve().parents[2]


def _sets(tokens: Path, steps: int = 4) -> list[str]:
    sets = [
        "model.preset=tiny",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=32",
        "model.ffn.kind=demix",
        f"data.path={tokens}",
        "data.tokenizer=gpt2",
        "data.domains=[cooking,finance]",
        f"train.steps={steps}",
        "train.micro_batch=2",
        "train.grad_accum=2",
        "train.lr=3e-3",
        "train.eval_batches=2",
        "parallel.zero_stage=1",
        "logging.log_interval=1",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
    ]
    return [a for s in sets for a in ("--set", s)]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"}


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1")


@pytest.mark.long
@pytest.mark.slow
def test_two_nodes_on_localhost_train_as_one_node(tiny_tokens, tmp_path):
    """DEMix, 2 domains on 4 ranks: 2 nodes x 2 ranks (--no-ssh, one launcher per node) vs 1 node x 4 ranks."""
    one, two = tmp_path / "one", tmp_path / "two"
    hosts = tmp_path / "hostfile"
    hosts.write_text("node0 slots=2\nnode1 slots=2\n")
    # the trainer on 4 ranks of one machine (tests/e2e/test_train.py)
    reference_run(_sets(tiny_tokens), 4, one)
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launcher.launch",
                "--hostfile",
                str(hosts),
                "--no-ssh",
                "--node-rank",
                str(k),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--run-dir",
                str(two),
                *_sets(tiny_tokens),
            ],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in (1, 0)
    ]
    outs = [n.communicate(timeout=600)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    a, b = _losses(one), _losses(two)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, a, b)
    start = next(r for r in read_metrics(two / "metrics.jsonl") if r.get("kind") == "start")
    assert start["world_size"] == 4
    assert (two / "command.sh").is_file() and (two / "command.node1.sh").is_file()
    assert (two / "model" / "meta.json").is_file()  # the export ran across both nodes
    # DeepSpeed's CPU shared-memory all-reduce segments (66 MB each) are released, not left in /dev/shm
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    hosts = tmp_path / "hostfile"
    hosts.write_text("node0 slots=4\nnode1 slots=4\nnode2 slots=2\n")
    return parse_args(["--hostfile", str(hosts), *extra])


def test_world_size_is_what_deepspeeds_runner_starts(tmp_path):
    """Computed with DeepSpeed's own resource functions: slots by default, --nproc per node whatever the slots
    say (as the runner's --num_gpus does), --num-nodes, --include/--exclude."""
    assert world_size(_args(tmp_path)) == 10
    # 3 on every node, node2 included (DeepSpeed's rule)
    assert world_size(_args(tmp_path, "--nproc", "3")) == 9
    assert world_size(_args(tmp_path, "--num-nodes", "2")) == 8
    assert world_size(_args(tmp_path, "--include", "node0@node2:0")) == 5
    assert node_resources(_args(tmp_path, "--exclude", "node1:0,1")) == {
        "node0": [0, 1, 2, 3],
        "node1": [2, 3],
        "node2": [0, 1],
    }
    assert world_size(parse_args(["--nproc", "3"])) == 3 and world_size(parse_args([])) == 1


def test_multi_node_options_pass_through_to_deepspeed(tmp_path):
    args = _args(
        tmp_path,
        "--no-ssh",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29511",
        "--launcher",
        "openmpi",
        "--ssh-port",
        "2222",
        "--num-nodes",
        "2",
    )
    cmd = build_command(args, tmp_path / "run", 29511)
    joined = " ".join(cmd)
    for piece in (
        "--hostfile",
        "--no_ssh --node_rank 1",
        "--master_addr 10.0.0.1",
        "--master_port 29511",
        "--launcher=openmpi",
        "--ssh_port=2222",
        "--num_nodes=2",
        "launcher/_rank_entry.py --run-dir",
        "--no_ssh --node_rank 1",
    ):
        assert piece in joined, (piece, joined)


def test_multi_node_options_without_a_hostfile_are_refused(tiny_tokens, tmp_path):
    args = parse_args(
        [
            "--nproc",
            "2",
            "--num-nodes",
            "2",
            "--include",
            "node0",
            "--run-dir",
            str(tmp_path / "run"),
            *_sets(tiny_tokens),
        ]
    )
    with pytest.raises(ConfigError) as err:
        prepare_run(args)
    assert "--include, --num-nodes select among the hosts of a --hostfile" in str(err.value)


@pytest.mark.parametrize(
    "extra, needles",
    [
        (
            ["--no-ssh"],
            ["--no-ssh needs --node-rank", "--no-ssh needs --master-addr", "--no-ssh needs --master-port"],
        ),
        (["--node-rank", "1"], ["--node-rank is only used with --no-ssh"]),
        (["--include", "node0", "--nproc", "2"], ["cannot be combined with --num-nodes/--nproc"]),
        (["--include", "node7"], ["node7"]),
        (
            ["--no-ssh", "--node-rank", "3", "--master-addr", "127.0.0.1", "--master-port", "29500"],
            ["--node-rank 3 is not a node of this launch", "node0, node1, node2"],
        ),
    ],
    ids=[
        "no-ssh-alone",
        "node-rank-without-no-ssh",
        "include-with-nproc",
        "unknown-host",
        "node-rank-out-of-range",
    ],
)
def test_impossible_multi_node_launches_fail_before_anything_starts(tiny_tokens, tmp_path, extra, needles):
    args = _args(tmp_path, *extra, "--run-dir", str(tmp_path / "run"), *_sets(tiny_tokens))
    with pytest.raises(ConfigError) as err:
        prepare_run(args)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.long
@pytest.mark.slow
def test_slurm_script_on_localhost_with_slurms_environment_simulated(tiny_tokens, tmp_path):
    """scripts/slurm_node.sh as srun runs it (one task per node), for a 2-node allocation: SLURM's variables set,
    `scontrol` answering for the allocation, the master address overridden to localhost."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] && printf "node0\\nnode1\\n"\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    run = tmp_path / "slurm-run"
    port = free_port()
    base = dict(
        _env(),
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_JOB_NUM_NODES="2",
        GPUS_PER_NODE="2",
        RUN_DIR=str(run),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    nodes = [
        subprocess.Popen(
            ["bash", "scripts/slurm_node.sh", *_sets(tiny_tokens, steps=2)],
            cwd=REPO,
            env=dict(base, SLURM_NODEID=str(k)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in (1, 0)
    ]
    outs = [n.communicate(timeout=600)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert sorted(_losses(run)) == [1, 2]
    start = next(r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "start")
    assert start["world_size"] == 4
    assert (run / "hostfile.node0").read_text() == "node0 slots=2\nnode1 slots=2\n"
    assert (run / "model" / "meta.json").is_file()


def test_slurm_script_outside_slurm_says_so():
    proc = subprocess.run(
        ["bash", "scripts/slurm_node.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
    )
    assert proc.returncode != 0 and "not inside a SLURM job" in proc.stderr


@pytest.mark.long
@pytest.mark.slow
def test_torchrun_two_nodes_on_localhost(tiny_tokens, tmp_path):
    """The trainer reads the standard environment: `torchrun --nnodes 2` (one agent per node) runs it as is."""
    run = tmp_path / "torchrun"
    port = free_port()
    env = dict(_env(), DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(k),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "launcher.train",
                "--run-dir",
                str(run),
                *_sets(tiny_tokens, steps=2),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in (1, 0)
    ]
    outs = [n.communicate(timeout=600)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert sorted(_losses(run)) == [1, 2]
    assert next(r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "start")["world_size"] == 4


def _shared_dir_worker(rank: int, world: int, dirs: list[str]) -> str:
    import torch

    from launcher.state import check_shared_run_dir

    try:
        check_shared_run_dir(Path(dirs[rank]), rank, world, torch.device("cpu"))
        return "ok"
    except ConfigError as e:
        return str(e)


def test_a_rank_without_the_shared_run_directory_stops_the_run_at_start(tmp_path):
    """3 gloo ranks; rank 2 looks at another directory (a node without the shared filesystem): every rank gets
    the same error naming rank 2, before any training; with one directory for all, nothing is raised."""
    from tests.harness.multirank import run_ranks

    shared, other = tmp_path / "shared", tmp_path / "elsewhere"
    assert run_ranks(_shared_dir_worker, 3, args=([str(shared)] * 3,), device_strict=True) == ["ok"] * 3
    out = run_ranks(_shared_dir_worker, 3, args=([str(shared), str(shared), str(other)],), device_strict=True)
    assert all("ranks [2] do not see the run directory" in o for o in out), out


# -- launchers that do not set torch's RANK (MPI runners, srun): launcher/distributed.py scheduler_env --------------

_MPI_ENVS = {
    "openmpi": lambda r, n: {
        "OMPI_COMM_WORLD_RANK": str(r),
        "OMPI_COMM_WORLD_SIZE": str(n),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(n),
    },
    "mvapich": lambda r, n: {
        "MV2_COMM_WORLD_RANK": str(r),
        "MV2_COMM_WORLD_SIZE": str(n),
        "MV2_COMM_WORLD_LOCAL_RANK": str(r),
        "MV2_COMM_WORLD_LOCAL_SIZE": str(n),
    },
    "mpich": lambda r, n: {
        "PMI_RANK": str(r),
        "PMI_SIZE": str(n),
        "MPI_LOCALRANKID": str(r),
        "MPI_LOCALNRANKS": str(n),
    },
    "srun": lambda r, n: {
        "SLURM_PROCID": str(r),
        "SLURM_STEP_NUM_TASKS": str(n),
        "SLURM_NTASKS": str(n),
        "SLURM_LOCALID": str(r),
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "localhost",
    },
}


def _bare_env() -> dict[str, str]:
    """This process's environment without any launcher's variables."""
    launcher_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {
        k: v
        for k, v in _env().items()
        if k not in launcher_vars and not k.startswith(("OMPI_", "MV2_", "PMI_", "MPI_LOCAL", "SLURM_"))
    }


@pytest.mark.parametrize("launcher", sorted(_MPI_ENVS))
def test_launcher_variables_become_torchs(launcher):
    from launcher.distributed import scheduler_env

    env = dict(_MPI_ENVS[launcher](3, 4), MASTER_ADDR="node0", MASTER_PORT="29511")
    assert scheduler_env(env) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "3",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29511",
        **({} if launcher == "srun" else {"LOCAL_WORLD_SIZE": "4"}),
    }
    # torch's own win (torchrun inside srun)
    assert scheduler_env(dict(env, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")) == {}


def test_srun_rendezvous_defaults_and_batch_shell():
    """srun without MASTER_*: the step's first host and the port slurm_node.sh uses; a batch script's own shell
    (SLURM_PROCID=0 and the job's SLURM_NTASKS, no SLURM_STEP_NUM_TASKS) is no rank of a world."""
    from launcher.distributed import first_slurm_host, scheduler_env

    env = dict(_MPI_ENVS["srun"](1, 2), SLURM_STEP_NODELIST="gpu[007-009,12],cpu1")
    assert scheduler_env(env)["MASTER_ADDR"] == "gpu007" and scheduler_env(env)["MASTER_PORT"] == str(
        29500 + 242
    )
    assert [first_slurm_host(h) for h in ("node1", "n1,n2", "a[1-2]b[3-4],c", "x[05]")] == [
        "node1",
        "n1",
        "a1b3",
        "x05",
    ]
    assert scheduler_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}) == {}


def test_launcher_without_a_rendezvous_or_a_local_rank_is_refused():
    from launcher.distributed import LaunchEnvError, scheduler_env

    with pytest.raises(LaunchEnvError, match="without MASTER_ADDR/MASTER_PORT.*mpirun -x MASTER_ADDR"):
        scheduler_env(_MPI_ENVS["openmpi"](0, 2))
    with pytest.raises(LaunchEnvError, match="LOCAL_RANK is not set"):
        scheduler_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert scheduler_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_LOCALID": "1"}) == {"LOCAL_RANK": "1"}
    assert scheduler_env({"RANK": "0", "WORLD_SIZE": "1"}) == {"LOCAL_RANK": "0"}


def test_each_rank_binds_its_own_gpu_also_when_it_sees_only_one():
    from launcher.distributed import LaunchEnvError, local_device_index

    assert [local_device_index(r, 8) for r in (0, 3, 7)] == [0, 3, 7]
    # srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES holds this task's GPU only
    assert local_device_index(5, 1) == 0
    with pytest.raises(LaunchEnvError, match="sees 2 GPUs"):
        local_device_index(3, 2)
    with pytest.raises(LaunchEnvError, match="no CUDA device"):
        local_device_index(0, 0)


@pytest.mark.parametrize("launcher", ["openmpi", "mvapich", "slurm"])
def test_mpi_and_slurm_launches_tell_the_ranks_the_rendezvous(tmp_path, launcher):
    args = _args(tmp_path, "--launcher", launcher)
    joined = " ".join(build_command(args, tmp_path / "run", 29533))
    assert "--master_addr node0" in joined and "--master-addr node0 --master-port 29533" in joined, joined
    pdsh = " ".join(build_command(_args(tmp_path), tmp_path / "run", 29533))
    assert "--master-port" not in pdsh  # DeepSpeed's own launch sets RANK and MASTER_* on every pdsh rank


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["openmpi", "srun"])
def test_mpi_or_srun_ranks_train_as_one_world(tiny_tokens, tmp_path, launcher):
    """Two trainer processes started as mpirun (launcher.launch --launcher openmpi passes --master-addr/port) or
    srun starts them: only the launcher's variables, no RANK. They must train as one world of 2, not as two
    worlds of one writing into the same run directory."""
    run, port = tmp_path / "run", free_port()
    extra = ["--master-addr", "127.0.0.1"] if launcher == "openmpi" else []
    env = dict(_bare_env(), DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO), MASTER_PORT=str(port))
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launcher.train",
                "--run-dir",
                str(run),
                *extra,
                *_sets(tiny_tokens, steps=2),
            ],
            cwd=REPO,
            env=dict(env, **_MPI_ENVS[launcher](r, 2)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (1, 0)
    ]
    outs = [p.communicate(timeout=600)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(o[-3000:] for o in outs)
    starts = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "start"]
    assert [s["world_size"] for s in starts] == [2]
    assert sorted(_losses(run)) == [1, 2]


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the CPU settings are for machines without CUDA"
)
def test_a_login_node_without_gpu_sends_no_cpu_settings_to_other_nodes(tiny_tokens, tmp_path):
    """srun (--launcher slurm) exports the launcher's whole environment to every rank: DS_ACCELERATOR=cpu from a
    GPU-less login node would put every GPU rank on DeepSpeed's CPU accelerator. Local and --no-ssh runs keep it."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "OMP_NUM_THREADS")}
    remote = _args(tmp_path, "--launcher", "slurm", "--run-dir", str(tmp_path / "a"), *_sets(tiny_tokens))
    here = parse_args(["--nproc", "2", "--run-dir", str(tmp_path / "b"), *_sets(tiny_tokens)])
    import unittest.mock

    with unittest.mock.patch.dict(os.environ, env, clear=True):
        assert "DS_ACCELERATOR" not in prepare_run(remote)[2]
        assert prepare_run(here)[2]["DS_ACCELERATOR"] == "cpu"
