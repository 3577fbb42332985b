"""`python -m kubetrain.cli ARGS`: the `kubetrain` command (what the local client and the export pod run)."""

import sys

from . import main

sys.exit(main())
