"""`LookaheadConfig`: the (W, N, G) of lookahead decoding and its options, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

FORMS = ("tree", "chains")


@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead decoding parameters.

    window (W): columns of the 2D window, how far ahead the lookahead branch decodes.
    ngram (N): n-gram size; the window keeps N - 1 levels of the Jacobi trajectory. N = 2 is Jacobi decoding.
    guesses (G): the most candidate n-grams verified per step (and kept per first token in the pool).
    pool_from_prompt: seed the pool with the prompt's n-grams (the paper's "prompt as reference").
    pool_from_output: also add the n-grams of the accepted output as it grows.
    form: the verification branch. "chains": the paper's, G candidate n-grams from the pool. "tree": one token
        tree of at most G(N - 1) nodes (the same tokens a step) merged from the draft sources below, verified
        down the tree, so shared prefixes are stored once and continuations can be longer than N - 1.
    draft_pool, draft_suffix, draft_recycle (tree form): the sources that feed the tree: the n-gram pool;
        earlier occurrences of the last tokens in prompt + output and what followed them; and the model's
        own top-k next tokens recorded at every row of every step, per token id ("token recycling").

    Exactness: with temperature 0 in float32 the tokens are those of plain greedy decoding; in
    float16/bfloat16 a multi-token pass rounds differently from a one-token pass, so near-ties can flip.

    The defaults (W=1, N=4, G=5: 18 tokens a step, 3 of them the lookahead branch and a tree of 15 nodes) measured
    the best tokens/s for the default model on a 2-core CPU (README, "The token tree": 1.36x our plain greedy and
    1.37x transformers' greedy on 8 dev prompts, against 1.30x for W=3, N=4, G=3, the former default, and 1.25-1.29x
    for the 8- and 12-token settings 1-3-3 and 1-4-3; N = 2 settings, with no Jacobi iteration, tied within noise
    at S 1.6-2.0; S 2.85 against 2.71 on all 35 dev prompts). A forward pass
    of 18 tokens costs a CPU about twice one of a single token, so the budget stays at 18 and goes mostly to the
    tree, which accepts more per token spent than the lookahead branch. On a GPU a forward pass of a few hundred
    tokens costs about as much as one, so use larger settings such as the paper's A100 ones (G = W): 7B W=15,
    N=5; 13B W=10, N=5; 33B W=7, N=5 (in tree form, moving part of that budget from W to G measured higher S on
    the CPU: S 4.15 for 10-5-20 against 4.03 for 15-5-15 on all 35 dev prompts).
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

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("ngram", 2), ("guesses", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LookaheadConfig.{name} must be an int, got {type(value).__name__} {value!r}")
            if value < low:
                raise ValueError(f"LookaheadConfig.{name} must be >= {low}, got {value}")
        for name in ("pool_from_prompt", "pool_from_output", "draft_pool", "draft_suffix", "draft_recycle"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LookaheadConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.form not in FORMS:
            raise ValueError(f"LookaheadConfig.form must be one of {', '.join(FORMS)}, got {self.form!r}")

