"""`python -m launcher.harness`: the package's command line (cli.py)."""

from data.cli import exit_process
from launcher.harness.cli import main

if __name__ == "__main__":
    exit_process(main())
