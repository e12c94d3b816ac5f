"""DeepSpeed's per-node launcher (`deepspeed.launcher.launch`), which `launcher.launch` starts in its place, with
what it lacks for preemption and for reporting:

- on SIGTERM/SIGINT, or when a rank fails, DeepSpeed stops the ranks one after another (SIGTERM to one rank's
  tree, up to 30 s, then the next); here every rank is signalled at once and given `train.preempt_grace_s`-like
  time (`STOP_WAIT_S`) to save (launcher/preemption.py), then SIGKILLed;
- ranks that exited 75 (preempted, state saved) are never signalled again: their peers are still saving;
- once stopping, a repeated SIGTERM/SIGINT (SLURM's to every process of the step, plus launcher.launch's
  forwarded copy) is ignored: DeepSpeed's handler, run a second time, exited 1 without waiting for the ranks;
- SIGUSR1 (what SLURM sends before a time limit: `#SBATCH --signal=...USR1@N`, scancel --signal=USR1, or
  launcher.launch forwarding either) is passed on to the live ranks, which save the step and exit 75, and this
  launcher waits for them: DeepSpeed's launcher has no handler for it, so SIGUSR1's default action killed it
  (status -10, reported by launcher.launch as 143) while its ranks were saving, and a batch script never saw 75;
- a rank killed by a signal is named (`rank 1 (pid N) killed by SIGKILL`) and the exit status is 128 + that
  signal, never 0; when every rank exited 75 so does this launcher (DeepSpeed would exit 1 or 75 by timing).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

from launcher.preemption import PREEMPTED_EXIT, signal_name

STOP_WAIT_S = 30.0  # a preempted rank's save, bounded by train.preempt_grace_s (25 s by default)
FAILED_STOP_WAIT_S = 5.0  # after a rank failed: the others cannot save (a peer is gone)


def main() -> int:
    import psutil
    from deepspeed.launcher import launch as ds

    ranks: list[tuple[subprocess.Popen, str]] = []
    stopped: set[int] = set()

    class _Subprocess:
        """`subprocess` for DeepSpeed's module, recording each rank's process and global rank."""

        def __getattr__(self, name: str) -> Any:
            return getattr(subprocess, name)

        def Popen(self, cmd: Any, *args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802
            p = subprocess.Popen(cmd, *args, **kwargs)
            ranks.append((p, (kwargs.get("env") or {}).get("RANK", "?")))
            return p

    def stop_all(_pid: int) -> None:
        """DeepSpeed calls this once per rank; the first call stops every live rank at once. Further SIGTERMs and
        SIGINTs are ignored from then on: SLURM signals every process of the job step and launcher.launch forwards
        the same signal, so a second one arrives while this waits, and DeepSpeed's handler, run again, would exit 1
        at once with the ranks still saving (the run reported as failed, the state saved all the same)."""
        if stopped:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        exited = [p.returncode for p, _ in ranks if p.poll() is not None]
        failed = any(c not in (0, PREEMPTED_EXIT) for c in exited)
        live = [p for p, _ in ranks if p.poll() is None]
        stopped.update(p.pid for p in live)
        stopped.add(-1)
        procs = []
        for p in live:
            try:
                procs.append(psutil.Process(p.pid))
                if not exited or failed:  # a rank that exited 75 has told its peers: they are saving
                    p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        # Popen.wait, not psutil.wait_procs: psutil would reap the ranks and Popen would then read status 0
        deadline = time.monotonic() + (FAILED_STOP_WAIT_S if failed else STOP_WAIT_S)
        for p, _ in ranks:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            if p.is_running():
                for q in [*p.children(recursive=True), p]:
                    try:
                        q.kill()
                    except psutil.NoSuchProcess:
                        pass
        for p, _ in ranks:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def forward(signum: int, _frame: object) -> None:
        """SIGUSR1: the same preemption request to every live rank (not their children); keep waiting for them."""
        for p, _ in ranks:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    ds.subprocess = _Subprocess()
    ds.terminate_process_tree = stop_all
    signal.signal(signal.SIGUSR1, forward)
    try:
        ds.main()
        code: int = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    codes = [p.returncode for p, _ in ranks]
    killed = [
        (r, p) for p, r in ranks if p.returncode is not None and p.returncode < 0 and p.pid not in stopped
    ]
    for r, p in killed:
        print(f"rank {r} (pid {p.pid}) killed by {signal_name(-p.returncode)}", file=sys.stderr, flush=True)
    if killed:
        return 128 - killed[0][1].returncode
    if codes and PREEMPTED_EXIT in codes and all(c in (0, PREEMPTED_EXIT) for c in codes):
        return PREEMPTED_EXIT
    if code == 0 and any(c != 0 for c in codes):  # never a success with a failed or signalled rank
        return next(c if c > 0 else 128 - c for c in codes if c != 0)
    return code


if __name__ == "__main__":
    sys.exit(main())
