"""`python -m launcher.modular.experts`: see launcher/modular/experts/cli.py."""

from data.cli import exit_process
from launcher.modular.experts.cli import main

if __name__ == "__main__":
    exit_process(main())
