"""`python -m lookahead generate "prompt"`: the `lookahead` command (which, unlike this, starts before torch loads)."""

import sys

from lookahead_cli import main

sys.exit(main())
