"""`python -m launcher.modular.hf_export`: see launcher/modular/hf_export/cli.py."""

from data.cli import exit_process
from launcher.modular.hf_export.cli import main

if __name__ == "__main__":
    exit_process(main())
