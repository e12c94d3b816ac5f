"""Record the golden loss curves again: `python -m tests.golden.record` (tests/golden/curves.py).

Builds the tiny corpus in a temporary folder, trains every architecture twice (two separate sets of ranks) and writes
tests/golden/<kind>.json only when the two runs agree exactly: a curve that is not reproducible here would only make
the test fail at random. Run it after a deliberate change of the numerics (the model, its init, the data, the
optimizer recipe, a torch upgrade) and commit the files with that change.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.golden.curves import (
    GOLDEN_DIR,
    KINDS,
    STEPS,
    WORLD,
    build_corpus,
    make_record,
    run_curves,
    write_record,
)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.golden.record", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=GOLDEN_DIR, help="where the JSON files go (default: tests/golden)"
    )
    args = ap.parse_args(argv)

    from launcher.rundir import use_extensions_dir
    from tests.harness.multirank import start_rank_server

    use_extensions_dir()  # the venv's cached shm op, as the trainer's own entry point does
    start_rank_server()
    runs = [(kind, kind, None) for kind in KINDS]
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        tokens = build_corpus(Path(tmp) / "corpus")
        print(f"training {', '.join(KINDS)} for {STEPS} steps on {WORLD} ranks, twice", file=sys.stderr)
        first = run_curves(tokens, Path(tmp) / "first", runs)
        second = run_curves(tokens, Path(tmp) / "second", runs)
        differ = [k for k in KINDS if first[k] != second[k]]
        if differ:
            for k in differ:
                print(f"{k}: first run {first[k]}\n{k}: second run {second[k]}", file=sys.stderr)
            print(
                f"not recorded: two identical runs of {', '.join(differ)} gave different losses on this machine "
                "(nondeterminism: threads, an unseeded random draw, a reduction order that varies)",
                file=sys.stderr,
            )
            return 1
        args.out.mkdir(parents=True, exist_ok=True)
        for k in KINDS:
            path = write_record(make_record(k, first[k], tokens), args.out)
            print(f"{path}: {', '.join(repr(v) for v in first[k])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
