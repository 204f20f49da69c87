"""`python -m lookahead generate "prompt"`."""

import sys

from .cli import main

sys.exit(main())
