"""One rank's training loop with the real preemption watch and fake work: `python -m tests.harness.preempt_loop JSON`.

It does what `launcher.train` does around `launcher.preemption` (`install` at start-up, `begin` before the first
step, `at_step_end` after every step with a save callback, `end` after the last, the saved line and exit status 75
on `Preempted`), with sleeps in place of the start-up, the steps, the save, the final export and the teardown, so
tests can send real signals at a chosen point in seconds instead of a training run. No process group: `requested`
reads this rank's own flag.

JSON keys: run_dir, grace_s, start (the step resumed from), steps, and the seconds of each phase: startup_s, step_s,
save_s, final_s, linger_s (after the saved line, before the exit: a slow teardown). Stdout says where it is, one
line each, flushed: `starting`, `step N` (step N in progress), `saving N`, `saved N`, `final`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from data.cli import exit_process
from launcher.preemption import PREEMPTED_EXIT, Preempted, install
from launcher.state_discovery import TRAINING_FORMAT


def write_state(run_dir: Path, step: int) -> Path:
    """An intact training state of `step` as `save_training_state` lays it out (one file, meta.json with its size),
    published through the `latest` pointer."""
    ck = run_dir / "checkpoints"
    state = ck / f"step_{step:08d}"
    state.mkdir(parents=True, exist_ok=True)
    (state / "trainer.pt").write_bytes(b"t" * 10)
    meta = {"format": TRAINING_FORMAT, "step": step, "files": {"trainer.pt": 10}}
    (state / "meta.json").write_text(json.dumps(meta))
    (ck / "latest").write_text(state.name + "\n")
    return state


def say(line: str) -> None:
    print(line, flush=True)


def main(o: dict) -> int:
    run_dir = Path(o["run_dir"])
    watch = install(o["grace_s"], 0, run_dir)
    say("starting")
    time.sleep(o.get("startup_s", 0))
    watch.begin(o["start"])
    try:
        for step in range(o["start"], o["steps"]):
            done = step + 1
            say(f"step {done}")
            time.sleep(o.get("step_s", 0))

            def save(done: int = done) -> Path:
                say(f"saving {done}")
                time.sleep(o.get("save_s", 0))
                state = write_state(run_dir, done)
                say(f"saved {done}")
                return state

            watch.at_step_end(done, "cpu", save)
    except Preempted as e:
        print(watch.saved_line(e), file=sys.stderr, flush=True)
        time.sleep(o.get("linger_s", 0))
        return PREEMPTED_EXIT
    watch.end(o["steps"])
    say("final")
    time.sleep(o.get("final_s", 0))
    return 0


if __name__ == "__main__":
    exit_process(main(json.loads(sys.argv[1])))
