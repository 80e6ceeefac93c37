#!/usr/bin/env python3
"""muser-sweep, geometry sweeps (CSV, Markdown, plots): `python scripts/sweep.py --help` (muser_ti/cli/sweep.py)."""

import sys

from muser_ti.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
