"""`python -m benchmarks.costmodel`: see benchmarks/costmodel/cli.py and docs/costmodel.md."""

import sys

from benchmarks.costmodel.cli import main

sys.exit(main())
