"""One rank of a launch: `python launcher/_rank_entry.py ARGS` runs exactly what `python -m launcher.train ARGS` runs.

DeepSpeed's runners are handed this file's path, not the module name: every runner (pdsh, openmpi, mvapich, mpich,
impi, slurm) can run a script, while `--module` reaches only some of them (SlurmRunner drops it and srun then runs
`python -u launcher.train`, a file that does not exist). The repository root replaces this file's directory on
`sys.path`, as `python -m` from the root would have it (the modules of launcher/ must not shadow top-level ones).
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("launcher.train", run_name="__main__", alter_sys=True)
