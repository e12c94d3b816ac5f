"""`make bench` (benchmarks/run.py) and the sweep under it (benchmarks/sweep.py): rendezvous ports reserved, not
guessed; a rerun re-times what it reports (reuse only with --reuse, marked); outputs under runs/ unless --record;
--data runs on any prepared corpus and refuses an unusable one before any work. No training runs here: launches
and the sweep are stubbed."""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from benchmarks import costmodel, report, run, sweep
from launcher.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
GOOD = {
    "name": "t",
    "base_config": "configs/demo/dense.yaml",
    "sizes": [{"name": "tiny", "preset": "tiny"}],
    "archs": ["dense"],
    "steps": 2,
}


def _plain_bind_fails(port: int) -> bool:
    """Whether a bind without SO_REUSEADDR (what any other program does) to `port` on every address fails."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as e:
            assert e.errno == errno.EADDRINUSE, e
            return True
    return False


def _fake_launch(ports: list[int]):
    """A `sweep._run_logged` that records the launch's --master-port, checks nobody else could bind it while the
    launch runs, and writes the metrics of a two-interval run instead of training."""

    def fake(cmd: list[str], log: Path, timeout_s: int):
        port = int(cmd[cmd.index("--master-port") + 1])
        assert _plain_bind_fails(port), "the port was not reserved during the launch"
        ports.append(port)
        run_dir = Path(cmd[cmd.index("--run-dir") + 1])
        recs = [{"kind": "start", "device": "cpu"}] + [
            {
                "kind": "train",
                "step": s,
                "loss": 5.0,
                "tokens_per_s": 1000.0 * s,
                "step_time_s": 1.0 / s,
                "peak_mem_gb": 0.5,
            }
            for s in (1, 2)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        log.write_text("fine\n")
        return 0, 0.1, False

    return fake


# ---------------------------------------------------------------------------- (a) ports


def test_concurrent_reservations_get_distinct_free_ports() -> None:
    n, got, errors = 8, [], []
    barrier = threading.Barrier(n)

    def reserve() -> None:
        try:
            barrier.wait(timeout=30)  # every thread reserves at the same moment
            sock = sweep.reserve_port()
            got.append(sock)
            barrier.wait(timeout=30)  # ... and holds it until every other one has reserved too
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reserve) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        ports = [s.getsockname()[1] for s in got]
        assert len(set(ports)) == n and all(p > 0 for p in ports)
        assert all(_plain_bind_fails(p) for p in ports)  # held: no other program can take one
    finally:
        for s in got:
            s.close()


def test_a_port_in_use_is_never_handed_out() -> None:
    """Ports with a listener (plain, or SO_REUSEADDR like a rendezvous store), an open connection or a closed one
    in TIME_WAIT are never reserved; a reserved port is never what a guessing launch (free_port) picks."""
    held: list[socket.socket] = []
    try:
        plain = socket.create_server(("127.0.0.1", 0))
        reuse = socket.socket()
        reuse.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reuse.bind(("", 0))
        reuse.listen()
        client = socket.create_connection(plain.getsockname())
        server_side, _ = plain.accept()
        tw_listener = socket.create_server(("127.0.0.1", 0))
        tw_client = socket.create_connection(tw_listener.getsockname())
        tw_server, _ = tw_listener.accept()
        tw_port = tw_listener.getsockname()[1]
        tw_server.close()  # the server side closes first: its port has a connection in TIME_WAIT
        tw_client.close()
        tw_listener.close()
        held += [plain, reuse, client, server_side]
        in_use = {plain.getsockname()[1], reuse.getsockname()[1], client.getsockname()[1], tw_port}
        reserved = [sweep.reserve_port() for _ in range(200)]
        held += reserved
        ports = {s.getsockname()[1] for s in reserved}
        assert len(ports) == 200 and not ports & in_use
        assert not ports & {free_port() for _ in range(200)}
    finally:
        for s in held:
            s.close()


def test_rank0_can_listen_on_its_reserved_port() -> None:
    """The reservation keeps the port for the launch's own rendezvous store (torch's TCPStore, both backends)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    for libuv in (True, False):
        with sweep.reserved_port() as port:
            store = TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10), use_libuv=libuv)
            store.set("k", "v")
            assert store.get("k") == b"v"
            del store


def test_each_local_point_runs_on_a_port_held_for_its_whole_launch(tmp_path: Path, monkeypatch) -> None:
    cfg = sweep.sweep_from_dict({**GOOD, "world_sizes": [1, 2]})
    ports: list[int] = []
    monkeypatch.setattr(sweep, "_run_logged", _fake_launch(ports))
    res = sweep.run_sweep(cfg, tmp_path / "sw")
    assert len(ports) == 2 and all(r["status"] == "ok" for r in res["points"])
    assert all(f"--master-port {p}" in r["command"] for p, r in zip(ports, res["points"]))
    assert not any(_plain_bind_fails(p) for p in ports)  # released once the launch ended
    multinode = sweep.sweep_from_dict({**GOOD, "launch": {"hostfile": "hosts"}})
    with sweep.point_port(
        multinode
    ) as port:  # the rendezvous is on the hostfile's first host: the launcher's
        assert port is None
    assert "--master-port" not in sweep.launch_command(multinode, sweep.points(multinode)[0], tmp_path)


# ---------------------------------------------------------------------------- (b) a rerun re-times


def test_a_rerun_retimes_every_point_unless_reuse_which_marks_them(tmp_path: Path, monkeypatch) -> None:
    cfg = sweep.sweep_from_dict({**GOOD, "world_sizes": [1, 2]})
    ports: list[int] = []
    monkeypatch.setattr(sweep, "_run_logged", _fake_launch(ports))
    first = sweep.run_sweep(cfg, tmp_path / "sw")
    assert all(
        r["finished"] and set(r["load"]) == {"loadavg_1m_start", "loadavg_1m_end", "others_cores"}
        for r in first["points"]
    )
    again = sweep.run_sweep(cfg, tmp_path / "sw")
    assert len(ports) == 4 and again["reused"] == [] and not any("reused_from" in r for r in again["points"])

    reused = sweep.run_sweep(cfg, tmp_path / "sw", reuse=True)
    assert len(ports) == 4  # nothing ran
    for old, row in zip(again["points"], reused["points"]):
        assert (
            row["reused_from"] == old["finished"]
            and row["load"] == old["load"]
            and row["wall_s"] == old["wall_s"]
        )
    assert [r["id"] for r in reused["reused"]] == ["tiny-dense-w1", "tiny-dense-w2"]

    changed = sweep.sweep_from_dict({**GOOD, "world_sizes": [1, 2], "set": ["train.eval_batches=1"]})
    assert sweep.run_sweep(changed, tmp_path / "sw", reuse=True)["reused"] == []  # another launch: re-timed
    assert len(ports) == 6


def test_report_marks_reused_points_with_their_date_and_load(tmp_path: Path) -> None:
    rows = [
        _row(1, 3000.0),
        {
            **_row(2, 5000.0),
            "reused_from": "2026-01-02 03:04:05",
            "load": {"loadavg_1m_start": 0.4, "loadavg_1m_end": 1.9, "others_cores": 0.1},
        },
    ]
    sweep.add_scaling(rows, cores=2)
    (tmp_path / "results.json").write_text(
        json.dumps({"sweep": {"name": "x"}, "machine": {"cores": 2}, "points": rows})
    )
    md = report.render(tmp_path, tmp_path / "out", costmodel=None)["md"].read_text()
    assert "| ok, reused from 2026-01-02 03:04:05 |" in md
    assert "1 of 2 points were reused from earlier runs" in md and "load average 0.4 to 1.9" in md
    # the fresh point is not marked
    assert "| tiny-dense-w1 | 1 | ok |" in md and "tiny-dense-w1 (reused" not in md


# ---------------------------------------------------------------------------- (c) outputs, (d) --data


def _row(world: int, tok: float) -> dict:
    return {
        "id": f"tiny-dense-w{world}",
        "size": "tiny",
        "arch": "dense",
        "world_size": world,
        "zero_stage": None,
        "tensor_parallel": None,
        "status": "ok",
        "error": None,
        "comm_share": None,
        "model": {"n_layers": 4, "d_model": 128},
        "num_experts": 0,
        "total_params": 1.9e6,
        "tflops_per_update": 0.015 * world,
        "micro_batch": 4,
        "grad_accum": 1,
        "tokens_per_s": tok,
        "tokens_per_s_per_rank": tok / world,
        "step_time_s": 1024 * world / tok,
        "tflops_per_gpu_recompute": 0.03,
        "tflops_per_gpu_no_recompute": 0.025,
        "mfu": None,
        "peak_mem_gb": 0.7,
        "final_loss": 8.5,
    }


class _Stubs:
    """benchmarks.run with the demo build and the sweep replaced by recorders (the sweep writes a results.json)."""

    def __init__(self, monkeypatch, runs: Path) -> None:
        self.demo_builds, self.sweeps = 0, []
        monkeypatch.setattr(run, "RUNS_DIR", runs)
        monkeypatch.setattr(run, "ensure_demo_data", self._demo)
        monkeypatch.setattr(sweep, "run_sweep", self._sweep)

    def _demo(self) -> None:
        self.demo_builds += 1

    def _sweep(self, cfg, sweep_dir: Path, *, reuse: bool = False, **kw) -> dict:
        self.sweeps.append({"cfg": cfg, "sweep_dir": sweep_dir, "reuse": reuse})
        rows = [_row(1, 3000.0), _row(2, 5000.0)]
        sweep.add_scaling(rows, cores=2)
        results = {
            "sweep": {"name": cfg.name},
            "machine": {"cores": 2, "loadavg_1m": 0.1},
            "reused": [],
            "points": rows,
        }
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / "results.json").write_text(json.dumps(results))
        return results


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in path.rglob("*")
        if p.is_file()
    }


def test_default_bench_writes_under_runs_and_nothing_under_benchmarks_results(
    tmp_path: Path, monkeypatch
) -> None:
    before = _tree(run.RECORD_DIR)
    stubs = _Stubs(monkeypatch, tmp_path / "runs")
    assert run.main([]) == 0
    assert _tree(run.RECORD_DIR) == before
    out = tmp_path / "runs" / "bench" / "sweep_cpu"
    assert (
        (out / "report.md").is_file() and (out / "report.html").is_file() and (out / "results.json").is_file()
    )
    assert (tmp_path / "runs" / "bench" / "costmodel_paper.json").is_file()
    assert "Cost model: the paper's 12 configurations" in (out / "report.md").read_text()
    bench = json.loads((out / "bench.json").read_text())
    assert bench["record"] is False and bench["data"] is None and bench["timings_s"]["sweep_s"] >= 0
    assert stubs.demo_builds == 1 and stubs.sweeps[0]["reuse"] is False
    assert stubs.sweeps[0]["sweep_dir"] == tmp_path / "runs" / "sweeps" / "cpu"


def test_record_writes_the_tracked_copies() -> None:
    paths = run.bench_paths("cpu", record=True)
    assert paths.out == ROOT / "benchmarks" / "results" / "sweep_cpu"
    assert (
        paths.costmodel_json
        == ROOT / "benchmarks" / "results" / "costmodel_paper.json"
        == report.COSTMODEL_JSON
    )
    assert run.costmodel_args(paths.costmodel_dir) == ["--paper"]  # the recorded command stays the same
    default = run.bench_paths("cpu")
    assert (
        default.out == ROOT / "runs" / "bench" / "sweep_cpu"
        and default.costmodel_dir == ROOT / "runs" / "bench"
    )
    assert run.costmodel_args(default.costmodel_dir)[1:] == ["--out-dir", str(ROOT / "runs" / "bench")]
    assert costmodel.RESULTS_DIR == run.RECORD_DIR


def test_data_sets_every_point_on_the_prepared_corpus(tiny_tokens: Path, tmp_path: Path) -> None:
    from data.catalog import load_catalog
    from launcher.config import load_run_config

    cfg = sweep.load_sweep(ROOT / "configs" / "sweeps" / "cpu.yaml")
    on_data = sweep.with_data(cfg, tiny_tokens)  # the only tokenizer prepared there: gpt2
    vocab = load_catalog(tiny_tokens, "gpt2").total_vocab_size(True)
    expected = [f'data.path="{tiny_tokens.resolve()}"', "data.tokenizer=gpt2", f"model.vocab_size={vocab}"]
    for pt in sweep.points(on_data):
        overrides = sweep.point_overrides(on_data, pt)
        assert overrides[-3:] == expected and overrides[:-3] == sweep.point_overrides(cfg, pt)
        cmd = sweep.launch_command(on_data, pt, tmp_path)
        assert [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"][-3:] == expected
    resolved = load_run_config(
        sweep.base_config_path(on_data), sweep.point_overrides(on_data, sweep.points(on_data)[0])
    )
    assert (resolved.data.path, resolved.data.tokenizer, resolved.model.vocab_size) == (
        str(tiny_tokens.resolve()),
        "gpt2",
        vocab,
    )
    assert sweep.with_data(cfg, tiny_tokens, "gpt2").set == on_data.set


def test_bench_on_data_runs_there_without_the_demo_build(
    tiny_tokens: Path, tmp_path: Path, monkeypatch
) -> None:
    stubs = _Stubs(monkeypatch, tmp_path / "runs")
    assert run.main(["--data", str(tiny_tokens), "--reuse"]) == 0
    assert stubs.demo_builds == 0 and stubs.sweeps[0]["reuse"] is True
    assert f'data.path="{tiny_tokens.resolve()}"' in stubs.sweeps[0]["cfg"].set
    bench = json.loads((tmp_path / "runs" / "bench" / "sweep_cpu" / "bench.json").read_text())
    assert bench["data"] == str(tiny_tokens.resolve())


def test_bench_refuses_unusable_data_before_any_work(
    tiny_tokens: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    def never(*a, **k):
        raise AssertionError("work started before --data was checked")

    for name in ("ensure_demo_data",):
        monkeypatch.setattr(run, name, never)
    monkeypatch.setattr(costmodel, "main", never)
    monkeypatch.setattr(sweep, "run_sweep", never)
    monkeypatch.setattr(run, "RUNS_DIR", tmp_path / "runs")

    assert run.main(["--data", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "manifest.json not found: prepare the data first" in err and "nowhere" in err

    assert run.main(["--data", str(tiny_tokens), "--tokenizer", "sentencepiece"]) == 2
    assert f"{tiny_tokens / 'sentencepiece' / 'manifest.json'} not found" in capsys.readouterr().err

    both = tmp_path / "both"
    shutil.copytree(tiny_tokens / "gpt2", both / "gpt2")
    shutil.copytree(tiny_tokens / "gpt2", both / "sentencepiece")
    assert run.main(["--data", str(both)]) == 2
    assert "several tokenizers (gpt2, sentencepiece): choose one with --tokenizer" in capsys.readouterr().err

    with pytest.raises(SystemExit) as e:
        run.main(["--tokenizer", "gpt2"])
    assert e.value.code == 2 and "give --data too" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- (e) the Makefile


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_help_and_bench_flags() -> None:
    # run as from a shell: under `make test` the parent make's MAKEFLAGS/MAKELEVEL would add "make[1]: ..." lines
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    }
    run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    helped = run(["make", "-s", "help"]).stdout
    assert helped.splitlines()[0].startswith("make venv") and "RECORD=1" in helped
    dry = run(
        [
            "make",
            "--no-print-directory",
            "-n",
            "bench",
            "RECORD=1",
            "BENCH_DATA=/some/tokens",
            "BENCH_TOKENIZER=gpt2",
        ]
    ).stdout
    assert '-m benchmarks.run --record --data "/some/tokens" --tokenizer gpt2' in dry
    plain = run(["make", "--no-print-directory", "-n", "bench"]).stdout
    assert plain.splitlines()[-1].split() == [".venv/bin/python", "-m", "benchmarks.run"]
