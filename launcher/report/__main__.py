"""`python -m launcher.report`: see launcher/report/__init__.py."""

from data.cli import exit_process
from launcher.report.cli import main

if __name__ == "__main__":
    exit_process(main())
