#!/usr/bin/env python3
"""muser-decode, the main job: a decode session through the route ladder: `python scripts/decode.py --help` (muser_ti/cli/decode.py)."""

import sys

from muser_ti.cli.decode import main

if __name__ == "__main__":
    sys.exit(main())
