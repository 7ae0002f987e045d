"""`python -m specfork.cli`: the `specfork` command."""

import sys

from specfork.cli import main

sys.exit(main())
