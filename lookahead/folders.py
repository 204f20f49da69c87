"""Where each installed package's code lives in the repository: the design puts `kernels/` and `models/` at the top
of the tree, and they install as `lookahead.kernels` and `lookahead.models`. Written here only: `setup.py` reads it
(without importing the package), `lookahead/__init__.py` checks an install against it, and the layering tests walk it.
"""

FOLDERS = {"lookahead": "lookahead", "lookahead.kernels": "kernels", "lookahead.models": "models"}
