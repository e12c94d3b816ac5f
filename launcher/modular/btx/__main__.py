"""`python -m launcher.modular.btx`: see launcher/modular/btx/cli.py."""

from data.cli import exit_process
from launcher.modular.btx.cli import main

if __name__ == "__main__":
    exit_process(main())
