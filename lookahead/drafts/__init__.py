"""Drafting: what a step verifies. The draft tree (`tree.py`), the tree form's policy that merges three sources
into it (`builder.py`: the n-gram pool, suffix matches, recycled top-k, scored by `edges.py`), and the chains
form's policy, the paper's candidates as a trie (`chains.py`); the drafting memory kept across generations
(`memory.py`)."""

from .builder import DraftBuilder, Sources
from .chains import ChainDrafts, chain_trie
from .memory import DraftMemory
from .pool import NGramPool
from .recycle import RecycleTables
from .suffix import SuffixIndex
from .tree import EMPTY, ROOT, BestFirst, DraftTree, preorder

__all__ = ["EMPTY", "ROOT", "BestFirst", "ChainDrafts", "DraftBuilder", "DraftMemory", "DraftTree", "NGramPool",
           "RecycleTables", "Sources", "SuffixIndex", "chain_trie", "preorder"]
