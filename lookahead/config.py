"""`LookaheadConfig`: the (W, N, G) of lookahead decoding and its options, validated on construction; the one home
of the defaults and of the rules that derive a configuration ("auto" per device, scaling over K processes).

Importing it loads no torch, so the CLI reads its defaults before torch is imported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FORMS = ("tree", "chains")
BUDGETS = ("auto", "fixed")

# `lookahead="auto"`: the maxima a self-tuned generation sizes its steps within, per device type. On a CPU the
# defaults (multi-token passes cost a CPU real compute: docs/results.md); on CUDA a deeper tree and window, since a
# GPU's pass of many tokens costs about one of a single token (a rule from the paper's A100 figures, not yet
# measured here: the self-tuned steps take what pays of it).
AUTO_MAXIMA = {"cpu": (1, 4, 5), "cuda": (4, 5, 30)}
# The most tokens one step may feed, (W + G)(N - 1): 4x the CUDA buckets' largest (256 a row) and 7.5x the paper's
# largest setting (15-5-15: 120). Past it a step costs even a GPU many one-token steps, and a CPU minutes: a
# configuration such as (1, 4, 10000) (30003 tokens a step) is refused here instead of running for hours.
MAX_STEP_TOKENS = 1024


@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead decoding parameters.

    window (W): columns of the 2D window, how far ahead the lookahead branch decodes.
    ngram (N): n-gram size; the window keeps N - 1 levels of the Jacobi trajectory. N = 2 is Jacobi decoding.
    guesses (G): the verification budget: a step verifies a token tree of at most G(N - 1) nodes
        (`tree_nodes`), the tokens G candidate n-grams take.
    pool_from_prompt: seed the n-gram pool with the prompt's n-grams (the paper's "prompt as reference").
    pool_from_output: also add the n-grams of the accepted output as it grows.
    form: how the verification tree is drafted. "tree" (the default): merged from the draft sources below, best
        expected nodes first, so shared prefixes are stored once and continuations can be longer than N - 1.
        "chains": the paper's G candidate n-grams from the pool, as a trie (one path per candidate); it accepts
        exactly what the paper's separate candidates accept.
    draft_pool, draft_suffix, draft_recycle (tree form): the sources that feed the tree: the n-gram pool;
        earlier occurrences of the last tokens in prompt + output and what followed them; and the model's
        own top-k next tokens recorded at every row of every step, per context ("token recycling").
    budget: how big each step is. "auto" (the default): each step takes the part of its draft tree (and the
        lookahead branch) that maximises expected tokens per second on this machine, by the model's measured cost
        of a step of T tokens (`lookahead.tuning`), with (W, N, G) as maxima; a plain one-token step when no
        draft pays. "fixed": every step at the full size (W + G)(N - 1), as in the paper (for its experiments,
        benchmarks and lookahead parallelism).
    warm: keep what drafting learned (recycled top-k, the suffix index, pool n-grams) on the model across
        generations, and draft from it; False: a generation neither reads nor writes that memory.

    Exactness: with temperature 0 in float32 the tokens are those of plain greedy decoding; in
    float16/bfloat16 a multi-token pass rounds differently from a one-token pass, so near-ties can flip.

    The defaults (1, 4, 5) give 18 tokens a step, 3 in the lookahead branch and a tree of 15 nodes: the best
    tokens/s measured for the default model on a 2-core CPU (docs/results.md, "Re-tuning the CPU default"). On a
    GPU, where a forward pass of a few hundred tokens costs about one of a single token, larger settings pay: the
    paper's A100 ones are G = W with N = 5 and W = 15 (7B), 10 (13B), 7 (33B).
    """

    window: int = 1
    ngram: int = 4
    guesses: int = 5
    pool_from_prompt: bool = True
    pool_from_output: bool = True
    form: str = "tree"
    draft_pool: bool = True
    draft_suffix: bool = True
    draft_recycle: bool = True
    budget: str = "auto"
    warm: bool = True

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("ngram", 2), ("guesses", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LookaheadConfig.{name} must be an int, got {type(value).__name__} {value!r}")
            if value < low:
                raise ValueError(f"LookaheadConfig.{name} must be >= {low}, got {value}")
        for name in ("pool_from_prompt", "pool_from_output", "draft_pool", "draft_suffix", "draft_recycle", "warm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LookaheadConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.step_tokens > MAX_STEP_TOKENS:
            raise ValueError(f"LookaheadConfig(window={self.window}, ngram={self.ngram}, guesses={self.guesses}) makes "
                             f"steps of (W + G)(N - 1) = {self.step_tokens} tokens; at most {MAX_STEP_TOKENS} are "
                             "accepted (the paper's largest setting, 15-5-15, is 120)")
        if self.form not in FORMS:
            raise ValueError(f"LookaheadConfig.form must be one of {', '.join(FORMS)}, got {self.form!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"LookaheadConfig.budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}")

    @property
    def tree_nodes(self) -> int:
        """The verification tree's node budget, G(N - 1): the tokens G candidate n-grams of N - 1 tokens take."""
        return self.guesses * (self.ngram - 1)

    @property
    def step_tokens(self) -> int:
        """Tokens of a full step: the lookahead branch's W(N - 1) plus the tree's G(N - 1)."""
        return (self.window + self.guesses) * (self.ngram - 1)

    def scaled(self, ranks: int) -> LookaheadConfig:
        """The paper's strong scaling for lookahead parallelism: K ranks hold K times the window and the
        verification budget of one (the CLI under torchrun and `lookahead="auto"` with a process group)."""
        return dataclasses.replace(self, window=self.window * ranks, guesses=self.guesses * ranks)

    @staticmethod
    def auto(device_type: str) -> LookaheadConfig:
        """`lookahead="auto"` on `device_type` ("cpu", "cuda"), for one prompt or a batch: the device's
        `AUTO_MAXIMA` with self-tuned steps (`budget="auto"`), which are plain steps wherever no draft pays."""
        return LookaheadConfig(*AUTO_MAXIMA.get(device_type, AUTO_MAXIMA["cpu"]))
