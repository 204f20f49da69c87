"""`python -m lookahead generate "prompt"`: the `lookahead` command."""

import sys

from lookahead.cli import main

sys.exit(main())
