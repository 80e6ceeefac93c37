#!/usr/bin/env python3
"""muser-model: the whole Muse Glimmer with the engine as its decode attention: `python scripts/model.py --help` (muser_ti/cli/model.py)."""

import sys

from muser_ti.cli.model import main

if __name__ == "__main__":
    sys.exit(main())
