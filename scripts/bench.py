#!/usr/bin/env python3
"""muser-bench, benchmarks against peers measured in the same run: `python scripts/bench.py --help` (muser_ti/cli/bench.py)."""

import sys

from muser_ti.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
