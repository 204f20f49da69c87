"""Self-tuned steps: the cost model (fit, online updates, its cache file), the per-step chooser on synthetic trees and
a fake clock, and the tokens, which no choice of step sizes may change."""

import itertools
import json
import math
import random

import pytest

from helpers import MockRowModel, MockStepModel, RandomCost, context_logits, decode_one, decode_rows, needs_interpreter
from lookahead import LookaheadConfig
from lookahead.models import Llama
from lookahead.models import tuning as model_tuning
from lookahead.request import GREEDY, SamplingParams
from lookahead.tuning import CostModel, Curve, StepBudget, budget, fit, knots_up_to, store
from lookahead.tuning import curve as curve_module

VOCAB = 40
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


def linear_cost(per_token: float, base: float = 1.0, largest: int = 256) -> CostModel:
    """t(T) = base + per_token * (T - 1): exact at every T (two knots, linear between)."""
    curve = Curve([1, largest], [base, base + per_token * (largest - 1)], [0.0, 0.0])
    return CostModel({"greedy": curve, "sampling": Curve(list(curve.knots), list(curve.base), [0.0, 0.0])})


def best_first_scores(rng: random.Random, n: int, high: float) -> list[float]:
    """Non-increasing scores as a best-first growth gives them."""
    return sorted((rng.uniform(0, high) for _ in range(n)), reverse=True)


# ---- the cost model ---------------------------------------------------------------------------------------------


def test_fit_recovers_a_linear_cost_in_tokens_and_length():
    true = lambda t, L: 0.02 + 0.003 * t + 2e-6 * t * L  # noqa: E731  (per-position cost grows with T)
    samples = [(t, L, true(t, L)) for t in knots_up_to(18) for L in (0, 900) for _ in range(2)]
    curve = fit(samples)
    assert curve.knots == [1, 2, 4, 8, 16, 18]
    for t in (1, 3, 7, 12, 18):
        for L in (0, 100, 900):
            assert curve.predict(t, L) == pytest.approx(true(t, L), rel=1e-9)


def test_observations_move_the_knots_around_a_step_towards_its_time():
    curve = fit([(t, 0, 1.0 + 0.1 * t) for t in (1, 2, 4, 8, 16)])
    before = [curve.predict(t, 0) for t in (1, 2, 4, 8, 16)]
    for _ in range(20):
        curve.observe(8, 0, 2 * before[3])  # the machine got busier for 8-token steps
    assert curve.predict(8, 0) == pytest.approx(2 * before[3], rel=0.02)
    assert curve.predict(1, 0) == before[0]  # a one-token step is slowed less by contention: judged by its own runs
    for t, was in zip((2, 16), (before[1], before[4]), strict=True):  # other multi-token sizes: half as far
        assert 1.05 * was < curve.predict(t, 0) < curve.predict(8, 0) / before[3] * was
    one = fit([(t, 0, 1.0) for t in (1, 8)])
    one.observe(8, 0, 100.0)  # a stray pause moves a knot by a bounded factor, not to 100 s
    assert one.predict(8, 0) == pytest.approx(1 + curve_module.UPDATE_RATE * (curve_module.MAX_RATIO - 1))


def test_a_stale_knot_is_overwritten_by_a_faster_step_and_moved_a_bounded_way_by_a_slower_one():
    """No step has run a knot of a curve just read or measured: its own step, faster, overwrites it (timing noise
    only adds time); slower, it moves it the bounded way (a pause is not a new machine). Once run, the knot is
    trusted again, and stale `STALE_AFTER` observations later; a stale knot its step confirmed, twice as late."""
    curve = Curve([1, 2, 8], [0.1, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert curve.stale_at(8) and curve.stale_at(2) and curve.floor(8, 0) == 0.0
    curve.observe(8, 0, 0.2)  # an 8-token step at a 15th of the file's figure
    assert curve.predict(8, 0) == pytest.approx(0.2) and not curve.stale_at(8)
    assert curve.predict(2, 0) == pytest.approx(0.2) and curve.stale_at(2)  # a smaller stale size: held to it
    assert curve.floor(9, 0) == pytest.approx(0.2) and curve.floor(7, 0) == 0.0
    curve.observe(8, 0, 0.1)  # run lately: a bounded move (the knots pooled where they cross)
    assert 0.2 * (1 - curve_module.UPDATE_RATE / 2) <= curve.predict(8, 0) < 0.19
    apart = Curve([1, 4, 8, 16], [0.1, 2.0, 3.0, 4.0], [0.0] * 4)
    apart.observe(16, 0, 4.0)  # knot 16 run now, as its figure says
    apart.observe(8, 0, 0.2)  # a stale figure's miss is its own: knot 16 is not moved by it, knot 4 held to it
    assert apart.base == pytest.approx([0.1, 0.2, 0.2, 4.0])
    fresh = Curve([1, 8], [0.1, 0.2], [0.0, 0.0])
    fresh.observe(8, 0, 20.0)  # stale but slower: a pause, moved the bounded way
    assert fresh.predict(8, 0) == pytest.approx(0.2 * (1 + curve_module.UPDATE_RATE * (curve_module.MAX_RATIO - 1)))
    confirmed = Curve([1, 8], [0.1, 0.2], [0.0, 0.0])
    confirmed.observe(8, 0, 0.2)
    for _ in range(2 * curve_module.STALE_AFTER - 1):
        confirmed.observe(1, 0, 0.1)
    assert not confirmed.stale_at(8)
    confirmed.observe(1, 0, 0.1)
    assert confirmed.stale_at(8)


def test_a_faster_stale_step_holds_only_stale_smaller_knots_to_it():
    """A stale knot overwritten by its faster step holds the smaller knots that are stale to its figure; a smaller
    knot a step ran lately keeps its own figure (where it now costs more than the larger one, the two are pooled by
    the monotone fit, not lowered to the larger's)."""
    curve = Curve([1, 2, 4], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    curve.observe(2, 0, 2.0)  # knot 2 run now, as its figure says: fresh
    assert not curve.stale_at(2) and curve.stale_at(1) and curve.stale_at(4)
    curve.observe(4, 0, 1.5)  # knot 4's own step, twice as fast as its (stale) figure: overwritten
    assert curve.base == pytest.approx([1.0, 1.75, 1.75])  # knot 2 pooled with knot 4, never lowered to 1.5


def test_a_one_token_step_much_faster_than_the_curve_rescales_it_and_makes_its_sizes_stale():
    """The plain step's time is measured at every step: one `SHIFT` times faster than the curve's t(1) (a batch's:
    its first knot) says the curve was measured on a slower moment; every knot is scaled by it and the others are
    measured again."""
    curve = Curve([1, 4, 8], [0.5, 1.0, 2.0], [1e-4, 2e-4, 4e-4])
    for tokens in (4, 8):
        curve.observe(tokens, 0, curve.predict(tokens, 0))
    assert not curve.stale_at(8)
    curve.observe(1, 100, 0.1 * curve.predict(1, 100))
    assert curve.base == pytest.approx([0.05, 0.1, 0.2]) and curve.per_position == pytest.approx([1e-5, 2e-5, 4e-5])
    assert curve.stale_at(4) and curve.stale_at(8) and not curve.stale_at(1)
    slower = Curve([1, 4], [0.1, 0.2], [0.0, 0.0])
    slower.observe(1, 0, 0.1 / curve_module.SHIFT * 1.01)  # not SHIFT times faster: its own knot only
    assert slower.base[1] == 0.2
    batch = Curve([4, 8, 16], [0.4, 0.8, 1.6], [0.0, 0.0, 0.0])  # measured for a batch of 4: its plain step is 4
    batch.observe(4, 0, 0.1)
    assert batch.base == pytest.approx([0.1, 0.2, 0.4]) and batch.stale_at(8) and not batch.stale_at(4)


def test_cost_model_round_trips_through_its_cache_file(tmp_path):
    cost = CostModel({"greedy": fit([(t, L, 0.01 * t + 1e-5 * L + 0.05) for t in (1, 4, 18) for L in (0, 500)])},
                     key={"device": "cpu:test", "threads": 2})
    path = tmp_path / "costs" / "x.json"
    cost.save(path)
    loaded = CostModel.load(path, cost.key)
    assert loaded == cost
    assert CostModel.load(path, {"device": "cpu:other", "threads": 2}) is None  # measured on something else
    assert CostModel.load(tmp_path / "missing.json") is None


@pytest.mark.parametrize("damage", ["not json {", "[]", '{"format": 1, "curves": {"greedy": {"knots": [1, 2]}}}',
                                    "negative", "nan", "unsorted", "unknown kind", "truncated"])
def test_a_damaged_cache_file_is_not_trusted(tmp_path, damage):
    cost = CostModel({"greedy": fit([(t, 0, 0.01 * t + 0.05) for t in (1, 4, 18)])}, key={"k": 1})
    path = tmp_path / "c.json"
    cost.save(path)
    data = json.loads(path.read_text())
    curve = data["curves"]["greedy"]
    if damage == "negative":
        curve["base"][1] = -1.0
    elif damage == "nan":
        curve["base"][0] = math.nan
    elif damage == "unsorted":
        curve["knots"] = [4, 1, 18]
    elif damage == "unknown kind":
        data["curves"]["fast"] = curve
    text = json.dumps(data)
    if damage == "truncated":
        text = text[: len(text) // 2]
    elif damage in ("not json {", "[]") or damage.startswith("{"):
        text = damage
    path.write_text(text)
    assert CostModel.load(path, {"k": 1}) is None


# ---- the chooser --------------------------------------------------------------------------------------------------


def brute_force(rows, branch: int, cost: CostModel, lengths, fixed, policy: str, against: float | None = None
                ) -> float:
    """The best rate of any per-row prefix sizes (against a rate R: the most expected tokens - R * seconds), by
    enumeration, written independently of `StepBudget.choose`."""
    carry = branch if policy == "always" else 1
    # the step's cache length: the mean over its tokens with every row at its base size (as the chooser reads it)
    length = (fixed.weight + sum(lengths) * carry) // (fixed.tokens + len(rows) * carry)

    def rate(sizes, per_row):
        tokens = fixed.tokens + sum(per_row + n for n in sizes)
        expected = fixed.expected + len(rows) + sum(sum(r[:n]) for r, n in zip(rows, sizes, strict=True))
        seconds = cost.predict(tokens, length)
        return expected / seconds if against is None else expected - against * seconds

    best = rate([0] * len(rows), 1)  # every row plain
    for sizes in itertools.product(*[range(len(r) + 1) for r in rows]):
        if policy == "always" or any(sizes):
            best = max(best, rate(list(sizes), carry))
    return best


@pytest.mark.parametrize("policy", budget.BRANCH_POLICIES)
def test_the_chooser_takes_the_best_slot_set_of_the_whole_step(monkeypatch, policy):
    """Rows with their own drafts, beside a fixed part (plain rows, prompt chunks): the chosen per-row sizes give the
    best expected tokens per second of any slot set (each row a prefix of its draft), by brute force."""
    monkeypatch.setattr(budget, "BRANCH", policy)
    rng = random.Random(0)
    kinds = set()
    for case in range(300):
        per_token = rng.choice([0.001, 0.01, 0.03, 0.1, 0.3])
        cost = CostModel({"greedy": Curve([1, 256], [1.0, 1.0 + per_token * 255], [1e-4, 1e-4 + per_token * 1e-3])})
        rows = [best_first_scores(rng, rng.randrange(0, 6), rng.choice([0.05, 0.3, 1.0]))
                for _ in range(rng.randrange(1, 4))]
        lengths = [rng.randrange(0, 400) for _ in rows]
        fixed = budget.Fixed(*rng.choice([(0, 0.0, 0), (3, 3.0, 300), (40, 0.0, 400)]))
        choices = StepBudget(LookaheadConfig(), cost).choose(rows, 3, lengths, fixed)
        carry = 3 if policy == "always" else 1
        sizes = [c.nodes for c in choices]
        tokens = fixed.tokens + sum((carry if c.branch else 1) + c.nodes for c in choices)
        length = (fixed.weight + sum(lengths) * carry) // (fixed.tokens + len(rows) * carry)
        expected = fixed.expected + len(rows) + sum(sum(r[:n]) for r, n in zip(rows, sizes, strict=True))
        got = expected / cost.predict(tokens, length)
        assert got == pytest.approx(brute_force(rows, 3, cost, lengths, fixed, policy), rel=1e-9), (case, rows)
        assert all(c.tokens == (carry if c.branch else 1) + c.nodes for c in choices)
        kinds.add("plain" if not any(sizes) else "all" if sizes == [len(r) for r in rows] else "part")
        if len(set(sizes)) > 1:
            kinds.add("rows differ")
    assert kinds == {"plain", "part", "all", "rows differ"}  # the cases exercised every outcome


@pytest.mark.parametrize("policy", budget.BRANCH_POLICIES)
def test_beside_prompt_chunks_a_slot_must_beat_the_rows_steady_rate(monkeypatch, policy):
    """A step that carries prompt chunks is dear, so nearly any draft node raises its own rate; but the node's time
    could have decoded at the steady rate R, the best rate of the step without the chunks. The chooser takes the slot
    set of the most expected tokens net of R times its seconds, by brute force; so weak drafts beside a long chunk take
    no slot, though they would have raised that step's own rate, and strong ones still do."""
    monkeypatch.setattr(budget, "BRANCH", policy)
    carry = 3 if policy == "always" else 1
    rng = random.Random(2)
    for case in range(200):
        cost = CostModel({"greedy": Curve([1, 512], [0.02, 0.02 + rng.choice([1e-4, 1e-3, 1e-2]) * 511],
                                          [1e-6, 1e-6 + 1e-9 * 511])})
        rows = [best_first_scores(rng, rng.randrange(0, 6), rng.choice([0.05, 0.3, 1.0]))
                for _ in range(rng.randrange(1, 4))]
        lengths = [rng.randrange(0, 400) for _ in rows]
        steady = budget.Fixed(*rng.choice([(0, 0.0, 0), (3, 3.0, 300)]))
        chunk = rng.choice([16, 100, 400])
        fixed = budget.Fixed(steady.tokens + chunk, steady.expected, steady.weight + chunk * rng.randrange(0, 400))
        choices = StepBudget(LookaheadConfig(), cost).choose(rows, 3, lengths, fixed, steady)
        target = brute_force(rows, 3, cost, lengths, steady, policy)
        sizes = [c.nodes for c in choices]
        tokens = fixed.tokens + sum((carry if c.branch else 1) + c.nodes for c in choices)
        length = (fixed.weight + sum(lengths) * carry) // (fixed.tokens + len(rows) * carry)
        expected = fixed.expected + len(rows) + sum(sum(r[:n]) for r, n in zip(rows, sizes, strict=True))
        got = expected - target * cost.predict(tokens, length)
        want = brute_force(rows, 3, cost, lengths, fixed, policy, against=target)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (case, rows)
    weak, strong = [[0.1 * 0.5**i for i in range(8)]] * 4, [[0.99] * 8] * 4  # a node: 0.1 tokens a ms, or 0.99
    cost = CostModel({"greedy": Curve([1, 512], [0.02, 0.02 + 1e-3 * 511], [0.0, 0.0])})  # a token: 5% of a pass
    chunk = budget.Fixed(400, 0.0, 0)
    assert any(c.nodes for c in StepBudget(LookaheadConfig(), cost).choose(weak, 3, [50] * 4, chunk))
    assert all(c.plain for c in StepBudget(LookaheadConfig(), cost).choose(weak, 3, [50] * 4, chunk,
                                                                           budget.NOTHING_FIXED))
    assert all(c.nodes == 8 for c in StepBudget(LookaheadConfig(), cost).choose(strong, 3, [50] * 4, chunk,
                                                                                budget.NOTHING_FIXED))
    chooser = StepBudget(LookaheadConfig(), cost)  # a curve just made: every knot stale, so a step may explore
    chooser.since_explored = budget.EXPLORE_EVERY
    chooser.choose(weak, 3, [50] * 4, chunk, budget.NOTHING_FIXED)
    assert chooser.explored == 0  # not a step beside chunks
    chooser.choose(weak, 3, [50] * 4)
    assert chooser.explored == 1  # the next one without them


def test_the_scheduler_sizes_a_step_beside_prompt_chunks_against_the_step_without_them(monkeypatch):
    """An engine whose second request arrives while the first decodes: the step that carries its prompt chunks hands
    the budget the rest of the step and that rest without the chunks; a step without chunks hands no second part."""
    from lookahead.loop import Engine
    from lookahead.request import Request

    seen = []
    choose = StepBudget.choose

    def spy(self, scores, branch, lengths, fixed=budget.NOTHING_FIXED, steady=None):
        seen.append((fixed, steady))
        return choose(self, scores, branch, lengths, fixed, steady)

    monkeypatch.setattr(StepBudget, "choose", spy)
    engine = Engine(MockRowModel(VOCAB, prefill_chunk=8), cost=linear_cost(0.01, base=0.02))
    first = engine.submit(Request([PROMPT], 60, GREEDY, LookaheadConfig(), frozenset()))  # decoding throughout
    while not seen:
        engine.step()
    plain_row = engine.submit(Request([[5, 4] * 10], 12, GREEDY, None, frozenset()))  # a plain row beside the chunks
    engine.submit(Request([[2, 3] * 10], 12, GREEDY, None, frozenset()))
    while engine.step():
        pass
    assert first.result().tokens and plain_row.result().tokens
    with_chunks = [(fixed, steady) for fixed, steady in seen if steady is not None]
    assert with_chunks and any(steady.tokens for _, steady in with_chunks)  # the plain row, once decoding
    for fixed, steady in with_chunks:  # the chunks (up to the model's 8 prompt tokens a step) give no token now
        assert 1 <= fixed.tokens - steady.tokens <= 8 and fixed.expected == steady.expected
    assert any(steady is None for _, steady in seen[1:])  # steps without chunks, after them


def test_a_plain_step_when_nothing_pays_and_the_full_budget_when_everything_does():
    cfg = LookaheadConfig()
    weak = StepBudget(cfg, linear_cost(0.2)).choose([[0.02] * cfg.tree_nodes] * 3, 3, [50] * 3)
    assert all(c.plain and c.tokens == 1 for c in weak)
    strong = StepBudget(cfg, linear_cost(0.001)).choose([[0.95**i for i in range(cfg.tree_nodes)]], 3, [50])
    assert strong[0].nodes == cfg.tree_nodes and not strong[0].branch and strong[0].tokens == 1 + cfg.tree_nodes


def test_rows_take_what_their_drafts_are_worth():
    """One step: a row with a strong draft takes all of it, a row with a worthless one none, a middling one part."""
    chooser = StepBudget(LookaheadConfig(), linear_cost(0.04))
    rows = [[0.95] * 15, [0.0, 0.0, 0.0], [0.6 * 0.8**i for i in range(15)]]
    strong, worthless, middling = chooser.choose(rows, 3, [10, 10, 10])
    assert strong.nodes == 15 and worthless.plain and 0 < middling.nodes < 15


def test_static_steps_carry_the_branch_and_fill_the_rounded_size():
    """With captured sizes a step's cost is its rounded size's: once it pays to go past a size, the slots up to the
    next are free, and the chooser takes them."""
    cfg = LookaheadConfig(4, 5, 30)  # branch 16
    round_up = lambda tokens: -(-tokens // 32) * 32  # noqa: E731
    rng = random.Random(1)
    for _ in range(100):
        cost = linear_cost(rng.choice([0.001, 0.005, 0.02]))
        rows = [best_first_scores(rng, rng.randrange(0, 121), rng.choice([0.1, 1.0])) for _ in range(2)]
        choices = StepBudget(cfg, cost, static=True, round_up=round_up).choose(rows, 16, [10, 10])
        if all(c.plain for c in choices):
            continue
        assert all(c.branch and c.tokens == 16 + c.nodes for c in choices)
        total = sum(c.tokens for c in choices)
        # nothing left under the rounded size that a row could have taken for free
        assert total == round_up(total) or all(c.nodes == len(r) for c, r in zip(choices, rows, strict=True))


def run_on_a_fake_clock(chooser: StepBudget, seconds_of, scores: list[float], steps: int, now: list[float],
                        length: int = 100) -> tuple[list, float]:
    """`steps` steps of one row whose draft scores `scores` (and whose steps accept what the scores promise), each
    taking `seconds_of(tokens)` on a fake clock `now` (the loop's own time none), recorded as the engine records them.
    The choices, and the tokens the steps gave."""
    choices, gave = [], 0.0
    for _ in range(steps):
        (choice,) = chooser.choose([scores], 3, [length])
        seconds = seconds_of(choice.tokens)
        now[0] += seconds
        promised = [sum(scores[: choice.nodes])] if choice.nodes else []
        chooser.record_cost(choice.tokens, length, seconds)
        chooser.record_drafts(promised, promised)
        choices.append(choice)
        gave += 1 + sum(promised)
    return choices, gave


SCORES = [0.4 * 0.7**i for i in range(15)]  # a draft worth about 1.3 tokens a step beside the model's own


@pytest.mark.parametrize("load", ["multi-token 10-20x", "all 15x, one-token 5x"])
def test_costs_measured_under_load_do_not_keep_a_quiet_machine_plain(tmp_path, load):
    """Issue 36 item 2: a cost file measured beside busy processes (multi-token passes 10-20x their quiet cost; or the
    whole machine slow), then a quiet run on a fake clock: within a few dozen steps the budget runs draft steps again
    and expects, and gets, more tokens per second than plain decoding."""
    quiet = lambda tokens: 0.1 * (1 + 0.03 * (tokens - 1))  # noqa: E731  (a CPU: each token ~3% of a pass)
    knots = knots_up_to(LookaheadConfig().step_tokens)
    loaded = [1, 10, 12, 15, 18, 20] if load.startswith("multi") else [5, 15, 15, 15, 15, 15]
    path = tmp_path / "costs.json"
    CostModel({"greedy": Curve(knots, [quiet(t) * f for t, f in zip(knots, loaded, strict=True)], [0.0] * 6)},
              key={"k": 1}).save(path)
    cost = CostModel.load(path, {"k": 1})
    assert cost.predict(8, 100) >= 10 * quiet(8)  # as measured under load
    now = [0.0]
    chooser = StepBudget(LookaheadConfig(), cost)
    choices, _ = run_on_a_fake_clock(chooser, quiet, SCORES, 24, now)
    assert any(c.tokens > 1 for c in choices)  # draft steps again within 24 steps
    start = now[0]
    choices, gave = run_on_a_fake_clock(chooser, quiet, SCORES, 24, now)
    plain = 1 / quiet(1)
    assert all(c.tokens > 1 and c.expected / c.seconds > plain for c in choices[-16:])
    assert gave / (now[0] - start) > 1.1 * plain  # and the fake clock agrees
    assert cost.predict(8, 100) < 1.5 * quiet(8)  # the file's figures were overwritten


class TimedModel(MockStepModel):
    """A mock model whose every pass advances a fake clock by what a pass of its tokens costs (`seconds_of`)."""

    def __init__(self, vocab, fn, seconds_of, now: list[float]) -> None:
        super().__init__(vocab, fn)
        self.seconds_of, self.now = seconds_of, now

    def step(self, tokens, pattern, rows, topk: int = 0, sample=None):
        self.now[0] += self.seconds_of(len(tokens))
        return super().step(tokens, pattern, rows, topk, sample)


def test_an_engine_on_a_poisoned_cost_file_decodes_faster_than_plain_within_a_few_dozen_steps(tmp_path):
    """The engine itself, on a fake clock: a cost model whose multi-token figures are 15x a quiet machine's (as read
    from a file measured beside busy processes), then a quiet generation: plain steps until the first exploration,
    lookahead steps only after two dozen, decoding faster than plain decoding; its tokens plain greedy's throughout."""
    from lookahead.loop import Engine, SingleRowModel
    from lookahead.request import Request

    quiet = lambda tokens: 0.1 * (1 + 0.03 * (tokens - 1))  # noqa: E731
    knots = knots_up_to(LookaheadConfig().step_tokens)
    path = tmp_path / "costs.json"
    CostModel({"greedy": Curve(knots, [quiet(t) * (1 if t == 1 else 15) for t in knots], [0.0] * len(knots))},
              key={"k": 1}).save(path)
    cost = CostModel.load(path, {"k": 1})
    target = [7, 8, 9, 10, 11, 12, 13, 14] * 30
    fn = lambda ctx: context_logits(ctx, VOCAB, target)  # noqa: E731  (drafts that are often right)
    prompt = target[:12]
    now = [0.0]
    stamps = []
    request = Request([prompt], 160, GREEDY, LookaheadConfig(), frozenset())
    (result,) = Engine(SingleRowModel(TimedModel(VOCAB, fn, quiet, now)), cost=cost, clock=lambda: now[0]).run(
        request, lambda tokens: stamps.append((now[0], len(tokens))))
    assert result.tokens == decode_one(MockStepModel(VOCAB, fn), prompt, 160).tokens
    sizes = result.step_sizes
    assert all(size == 1 for size in sizes[:7]) and any(size > 1 for size in sizes[:24])
    assert len(sizes) > 30 and all(size > 1 for size in sizes[24:])  # then lookahead steps only
    later = stamps[24:]
    rate = sum(n for _, n in later[1:]) / (later[-1][0] - later[0][0])
    assert rate > 1.5 / quiet(1)  # faster than plain decoding, on the fake clock


class TimedRowModel(MockRowModel):
    """`MockRowModel` whose every step advances a fake clock by what a pass of all its rows' tokens costs."""

    def __init__(self, vocab, fn, seconds_of, now: list[float], **kwargs) -> None:
        super().__init__(vocab, fn, **kwargs)
        self.seconds_of, self.now = seconds_of, now

    def step(self, steps):
        self.now[0] += self.seconds_of(sum(len(s.tokens) for s in steps))
        return super().step(steps)


def test_idle_waits_prompts_and_request_setup_are_not_the_loops_own_time(monkeypatch):
    """What the budget adds to a step's cost is the loop's own time in the steps it sizes; none of these is: a
    server's idle wait between steps, a step of a prompt alone, a new request's setup (its lookahead loop, built when
    its prompt's last chunk is done; tens of ms for a long prompt). An engine on a fake clock: a minute of idle wait
    before each step; a second request that arrives while the first decodes, its prompt chunked beside it and its
    setup costing 64 s; a third once both are done. Every step is sized as without the waits, and h is the 1/128 s a
    row of sending a step's tokens. (Counted, a wait or a setup made h seconds long, every step looked cheap beside
    it, and the budget took the largest.)"""
    from lookahead.loop import Engine
    from lookahead.loop import jobs as jobs_module
    from lookahead.request import Request

    # every time a multiple of 2^-9 s: the fake clock's sums are exact, so both runs time every step alike
    quiet = lambda tokens: (128 + 2 * (tokens - 1)) / 1024  # noqa: E731  (an 18-token step: 1.27 plain ones)
    target = [7, 8, 9, 10, 11, 12, 13, 14] * 30
    fn = lambda ctx: context_logits(ctx, VOCAB, [*target[:40], 3, 5, *target[40:]])  # noqa: E731
    loop_class = jobs_module.LookaheadLoop

    def run(idle: float) -> tuple[list[list[int]], float, float]:
        now = [0.0]

        def set_up(*args, **kwargs):
            now[0] += 64.0
            return loop_class(*args, **kwargs)

        monkeypatch.setattr(jobs_module, "LookaheadLoop", set_up)
        cost = CostModel({"greedy": fit([(t, 0, quiet(t)) for t in knots_up_to(LookaheadConfig().step_tokens)])})
        engine = Engine(TimedRowModel(VOCAB, fn, quiet, now, prefill_chunk=16), cost=cost, clock=lambda: now[0])
        results = []

        def sink(delta) -> None:
            now[0] += 1 / 128  # sending a step's tokens: the loop's own time
            if delta.result is not None:
                results.append(delta.result)

        def submit(prompt: list[int]) -> None:
            engine.submit(Request([prompt], 48, GREEDY, LookaheadConfig(), frozenset()), sink=sink)

        most = 0.0  # the largest h of any step

        def step(steps: int | None = None) -> None:
            nonlocal most
            while (steps is None or steps > 0) and engine.step():
                now[0] += idle
                most = max([most, *(b.host for b in engine.scheduler.budgets.values())])
                steps = None if steps is None else steps - 1

        submit(target[:12])
        step(6)
        submit(target[3:43])  # chunked beside the first row's lookahead steps
        step()
        submit(target[5:30])
        step()
        (budget,) = engine.scheduler.budgets.values()
        return [result.step_sizes for result in results], budget.host, most

    sizes, host, most = run(0.0)
    assert any(size > 4 for row in sizes for size in row) and any(size < 4 for row in sizes for size in row)
    assert 0.5 / 128 < host <= 1 / 128  # 1/128 s a step alone (its last tokens are sent after it)
    assert most <= 2 / 128  # and 1/128 s a row when two rows send
    assert run(64.0) == (sizes, host, most)


def test_a_size_that_is_truly_dear_is_explored_ever_more_rarely():
    """Exploration is bounded: where a 2-token step truly costs 1.8 one-token steps (measured right, but not yet run
    by a step of this process), steps of draft sizes run only now and then, ever more rarely, and the run keeps
    plain decoding's rate to within a few percent."""
    dear = lambda tokens: 0.1 * (1 + 0.8 * (tokens - 1))  # noqa: E731
    cost = CostModel({"greedy": fit([(t, 100, dear(t)) for t in knots_up_to(LookaheadConfig().step_tokens)])})
    now = [0.0]
    chooser = StepBudget(LookaheadConfig(), cost)
    choices, gave = run_on_a_fake_clock(chooser, dear, SCORES, 400, now)
    explored = [i for i, c in enumerate(choices) if c.tokens > 1]
    assert 1 <= len(explored) <= 8 and chooser.explored == len(explored)
    assert all(b - a >= budget.EXPLORE_EVERY for a, b in zip(explored, explored[1:], strict=False))
    assert sum(i >= 200 for i in explored) <= 2  # ever more rarely
    assert gave / now[0] >= 0.97 / dear(1)


def test_static_steps_explore_a_stale_bucket_at_its_fullest():
    """With captured sizes (CUDA graphs) an exploration runs a stale bucket with as many nodes as it holds (padding
    costs the same), and a poisoned curve is corrected bucket by bucket."""
    cfg = LookaheadConfig(4, 5, 30)  # branch 16
    round_up = lambda tokens: 1 if tokens == 1 else -(-tokens // 32) * 32  # noqa: E731  (plain steps: 1 token)
    quiet = lambda tokens: 0.1 * (1 + 0.002 * (round_up(tokens) - 1))  # noqa: E731  (a GPU: tokens nearly free)
    knots = [1, 32, 64, 96, 128]
    cost = CostModel({"greedy": Curve(knots, [quiet(t) * (1 if t == 1 else 15) for t in knots], [0.0] * 5)})
    now = [0.0]
    chooser = StepBudget(cfg, cost, static=True, round_up=round_up)
    scores = [0.5 * 0.9**i for i in range(100)]
    sizes = []
    for _ in range(48):
        (choice,) = chooser.choose([scores], 16, [100])
        seconds = quiet(choice.tokens)
        now[0] += seconds
        promised = [sum(scores[: choice.nodes])] if choice.nodes else []
        chooser.record_cost(choice.tokens, 100, seconds)
        chooser.record_drafts(promised, promised)
        sizes.append(choice.tokens)
    first = next(i for i, t in enumerate(sizes) if t > 1)
    assert first < budget.EXPLORE_EVERY + 1 and sizes[first] == 32  # the first bucket, full: 16 + 16 nodes
    assert all(t == round_up(t) or t == 16 + len(scores) for t in sizes if t > 1)
    assert min(sizes[-8:]) >= 64  # larger buckets pay once measured again


def test_exploration_runs_only_a_size_that_could_win():
    """A stale knot is explored only where, as cheap as the knots run lately allow, it would beat the step the budget
    takes: with a fresh knot 2 that makes a 2-token step dear, the stale 4-, 8- and 16-token knots (the curve is
    monotone) are not worth a step."""
    cost = CostModel({"greedy": Curve([1, 2, 4, 8, 16], [0.1, 1.0, 1.0, 1.0, 1.0], [0.0] * 5)})
    now = [0.0]
    chooser = StepBudget(LookaheadConfig(), cost)
    for tokens in (1, 2):
        cost.observe(tokens, 100, cost.predict(tokens, 100))  # run now: neither stale
    choices, _ = run_on_a_fake_clock(chooser, lambda tokens: 0.1 if tokens == 1 else 1.0, SCORES, 3 * 8, now)
    assert all(c.plain for c in choices) and chooser.explored == 0


def test_the_chooser_learns_a_machine_that_gets_busier_on_a_fake_clock():
    """Steps cost what a fake clock says: quiet, an 18-token step costs 1.3 one-token steps (most of the tree pays);
    then contention makes an 18-token step cost 11 one-token steps, and within a few steps the chooser runs plain
    steps."""
    now = [0.0]
    cost = CostModel({"greedy": fit([(t, 0, 0.05 * (1 + 0.3 * (t - 1) / 17)) for t in (1, 2, 4, 8, 16, 18)])})
    chooser = StepBudget(LookaheadConfig(), cost)
    scores = [0.4 * 0.7**i for i in range(15)]
    plain_at = None
    for step in range(40):
        busy = step >= 10
        explored = chooser.explored
        (choice,) = chooser.choose([scores], 3, [100])
        if step < 10 and chooser.explored == explored:  # (an exploration may run a smaller size once)
            assert choice.nodes >= 5
        seconds = 0.05 * (1 + (10.0 if busy else 0.3) * (choice.tokens - 1) / 17)
        now[0] += seconds
        expected = sum(scores[: choice.nodes])
        promised = [expected] if choice.nodes else []
        chooser.record_cost(choice.tokens, 100, seconds)
        chooser.record_drafts(promised, promised)  # the scores as good as promised
        if busy and choice.plain and plain_at is None:
            plain_at = step
    assert plain_at is not None and plain_at <= 16


def test_calibration_follows_what_the_steps_accepted_in_each_band():
    chooser = StepBudget(LookaheadConfig(), linear_cost(0.02))
    (choice,) = chooser.choose([[0.9] * 15], 3, [10])
    assert not choice.plain
    for _ in range(30):  # the scores promised 13.5 nodes a step; none was accepted
        chooser.record_cost(choice.tokens, 10, 0.1)
        chooser.record_drafts([13.5], [0])
    assert chooser.calibrated(13.5) < 0.02 * 13.5
    assert chooser.choose([[0.9] * 15], 3, [10])[0].nodes < 5  # prefixes of the band that failed no longer pay
    assert chooser.calibrated(0.6) == 0.6  # another band: its own evidence (none yet)
    for _ in range(30):  # rows expected to accept 0.6 nodes accepted 1.2
        chooser.record_cost(choice.tokens, 10, 0.1)
        chooser.record_drafts([0.6, 0.6], [1, 2])
    prior = budget.CALIBRATION_PRIOR
    assert chooser.calibrated(0.6) == pytest.approx(0.6 * (90 + prior) / (36 + prior))


# ---- the tokens ----------------------------------------------------------------------------------------------------

CONFIGS = [LookaheadConfig(), LookaheadConfig(3, 3, 3), LookaheadConfig(2, 4, 6)]


@pytest.mark.parametrize("policy", budget.BRANCH_POLICIES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"W{c.window}-N{c.ngram}-G{c.guesses}")
def test_greedy_with_any_step_sizes_is_plain_greedy_on_the_mock(monkeypatch, cfg, static, policy):
    monkeypatch.setattr(budget, "BRANCH", policy)
    target = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12] * 4
    fn = lambda ctx: context_logits(ctx, VOCAB, target)  # noqa: E731  (drafts that are often right)
    sizes = set()
    for seed in range(4):
        prompt = PROMPT[seed:] + target[:9]
        plain = decode_one(MockStepModel(VOCAB, fn), prompt, 40).tokens
        result = decode_one(MockStepModel(VOCAB, fn), prompt, 40, GREEDY, cfg, static_step=static,
                            cost=RandomCost(seed))
        assert result.tokens == plain
        assert len(result.step_sizes) == result.steps - 1
        sizes.update(result.step_sizes)
    assert 1 in sizes and len(sizes) >= 3  # plain steps and several lookahead sizes were met


def test_budget_fixed_keeps_the_full_steps():
    """A cost model changes nothing for `budget="fixed"`: the same steps as without one."""
    fn = lambda ctx: context_logits(ctx, VOCAB, list(range(5, 30)) * 2)  # noqa: E731
    cfg = LookaheadConfig(budget="fixed")
    without = decode_one(MockStepModel(VOCAB, fn), PROMPT, 30, GREEDY, cfg)
    model = MockStepModel(VOCAB, fn)
    result = decode_one(model, PROMPT, 30, GREEDY, cfg, cost=linear_cost(10.0))
    assert (result.tokens, result.step_tokens, result.step_sizes) == (without.tokens, without.step_tokens,
                                                                      without.step_sizes)
    assert max(result.step_sizes) > 1


def test_a_batch_with_any_step_sizes_equals_each_row_alone():
    fn = lambda ctx: context_logits(ctx, VOCAB, list(range(4, 24)) * 3)  # noqa: E731
    prompts = [PROMPT, PROMPT[:6] + [4, 5, 6], [9, 8, 7, 4, 5]]
    model = MockRowModel(VOCAB, fn)
    cfg = LookaheadConfig(3, 3, 3)
    rows = decode_rows(model, prompts, 24, GREEDY, cfg, cost=RandomCost(3))
    assert [r.tokens for r in rows] == [decode_one(MockStepModel(VOCAB, fn), p, 24).tokens for p in prompts]
    shapes = {p.num_tokens for p in model.patterns}
    assert 1 in shapes and len(shapes) > 1
    assert any(len(set(sizes)) > 1 for sizes in model.row_sizes)  # rows of one step sized apart


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_k=3),
                                    SamplingParams(0.7, top_p=0.9)], ids=["T1", "T0.7", "T1-topk3", "T0.7-topp0.9"])
def test_seeded_sampling_with_any_step_sizes_is_seeded_plain_sampling(params):
    fn = lambda ctx: context_logits(ctx, VOCAB)  # noqa: E731
    for seed in range(6):
        plain = decode_one(MockStepModel(VOCAB, fn), PROMPT, 24, params, seed=seed).tokens
        for static in (False, True):
            result = decode_one(MockStepModel(VOCAB, fn), PROMPT, 24, params, LookaheadConfig(3, 3, 3), seed=seed,
                                static_step=static, cost=RandomCost(seed))
            assert result.tokens == plain, (seed, static)
    prompts = [PROMPT, PROMPT[:7]]
    rows = decode_rows(MockRowModel(VOCAB, fn), prompts, 16, params, LookaheadConfig(), seeds=[4, 5],
                       cost=RandomCost(9))
    assert [r.tokens for r in rows] == [decode_one(MockStepModel(VOCAB, fn), p, 16, params, seed=s).tokens
                                        for p, s in zip(prompts, [4, 5], strict=True)]


# ---- the real model ----------------------------------------------------------------------------------------------


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The cost models' cache folder, in a temporary folder."""
    monkeypatch.setattr(store, "cache_dir", lambda: tmp_path / "costs")
    return tmp_path


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_tiny_llama_greedy_with_any_step_sizes_is_plain_greedy(tiny_checkpoint, backend):
    model = Llama.from_pretrained(tiny_checkpoint(), attn_backend=backend)
    model.cost_model = RandomCost(1)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = model.generate(prompt, max_new_tokens=14 if backend == "triton" else 30, eos_token_id=[]).tokens
    result = model.generate(prompt, max_new_tokens=len(plain), eos_token_id=[], lookahead=LookaheadConfig())
    assert result.tokens == plain
    assert len(set(result.step_sizes)) > 1


def test_the_cost_model_is_measured_once_then_read_from_its_cache(tiny_checkpoint, cache_dir, monkeypatch):
    measured = []
    real = model_tuning.measure
    monkeypatch.setattr(model_tuning, "measure", lambda *a: measured.append(1) or real(*a))
    first = Llama.from_pretrained(tiny_checkpoint())
    first.generate([1, 2, 3], max_new_tokens=6, lookahead=LookaheadConfig())
    assert measured == [1]
    curve = first.cost_model.curves["greedy"]
    assert curve.knots == knots_up_to(LookaheadConfig().step_tokens)
    (path,) = (cache_dir / "costs").iterdir()
    # another process's model of the same shape starts from the file
    second = Llama.from_pretrained(tiny_checkpoint())
    second.generate([1, 2, 3], max_new_tokens=6, lookahead=LookaheadConfig())
    assert measured == [1] and second.cost_model.curves["greedy"].knots == curve.knots
    # sampling is another kind of step: measured once too
    second.generate([1, 2, 3], max_new_tokens=6, lookahead=LookaheadConfig(), temperature=1.0, seed=0)
    assert measured == [1, 1] and set(second.cost_model.curves) == {"greedy", "sampling"}
    # a damaged file is measured again and rewritten
    path.write_text('{"format": 1, "curves": {"greedy": {"knots": [1], "base": [-5], "per_position": [0]}}}')
    third = Llama.from_pretrained(tiny_checkpoint())
    third.generate([1, 2, 3], max_new_tokens=6, lookahead=LookaheadConfig())
    assert measured == [1, 1, 1] and CostModel.load(path, third.cost_model.key) is not None
    # a cost model set by the user is used as it is; plain decoding and fixed steps measure nothing
    fourth = Llama.from_pretrained(tiny_checkpoint())
    mine = linear_cost(0.01)
    fourth.cost_model = mine
    fourth.generate([1, 2, 3], max_new_tokens=6, lookahead=LookaheadConfig())
    fifth = Llama.from_pretrained(tiny_checkpoint())
    fifth.generate([1, 2, 3], max_new_tokens=6)
    fifth.generate([1, 2, 3], max_new_tokens=6, lookahead=LookaheadConfig(budget="fixed"))
    assert measured == [1, 1, 1] and fourth.cost_model is mine and fifth.cost_model is None


def test_the_cost_model_is_measured_when_the_pool_is_nearly_full(tiny_checkpoint):
    """A measurement on a runner whose free blocks hold less than one timed step (a pool sized for short requests,
    the rest holding cached prefixes) makes room for its steps; it once failed: "18 tokens at L=0 overflow its 16
    positions"."""
    from helpers import one
    from lookahead.models.runner import CachedRunner

    model = Llama.from_pretrained(tiny_checkpoint())
    config = LookaheadConfig()
    runner = CachedRunner(model, 2, config.step_tokens)
    runner.admit([], 16)
    assert runner.blocks.free == 1
    request = one([1, 2, 3], 8, lookahead=config)
    curve = model_tuning.measure(runner, request, knots_up_to(config.step_tokens))
    assert curve.knots == knots_up_to(config.step_tokens) and runner.blocks.free >= 1


def test_warmup_measures_the_cost_model_and_prepares_every_shape(tiny_checkpoint, cache_dir):
    model = Llama.from_pretrained(tiny_checkpoint())
    cfg = LookaheadConfig(2, 3, 8)
    model.warmup(cfg, max_tokens=64, batch=2, static_step=True)
    assert model.cost_model is not None and "greedy" in model.cost_model.curves
    prepared = set(model.runner.step_shapes)
    assert prepared == set(model.runner.decode_shapes(2, cfg.step_tokens, 8))
    model.cost_model = RandomCost(2)
    model.generate([[1, 2, 3, 1, 2, 3], [4, 5, 6]], max_new_tokens=20, lookahead=cfg, eos_token_id=[],
                   static_step=True)
    assert set(model.runner.step_shapes) == prepared  # no shape met mid-generation


def test_auto_is_the_device_maxima_with_self_tuned_steps():
    assert LookaheadConfig.auto("cpu") == LookaheadConfig()
    cuda = LookaheadConfig.auto("cuda")
    assert cuda.budget == "auto" and cuda.step_tokens > LookaheadConfig().step_tokens
    with pytest.raises(ValueError, match="budget must be one of auto, fixed"):
        LookaheadConfig(budget="adaptive")


def test_the_summary_compares_with_plain_decoding_here():
    from lookahead.cli.report import Notes, Timed, summary
    from lookahead.loop import GenerationResult

    result = GenerationResult(tokens=list(range(24)), steps=10, step_tokens=[], step_sizes=[18] * 9)
    run = Timed(result, 1.0)
    line = summary(run, LookaheadConfig(), notes=Notes(plain_rate=16.0))
    assert line.endswith("S=2.40, 24.0 tok/s (plain ~16 tok/s here)") and "self-tuned" in line
    assert "here" not in summary(run, LookaheadConfig(budget="fixed")) and "self-tuned" not in line.replace(
        "self-tuned", "", 1)


def test_a_cost_model_without_a_sampling_curve_sizes_sampled_steps_by_its_greedy_one():
    fn = lambda ctx: context_logits(ctx, VOCAB, list(range(5, 30)) * 2)  # noqa: E731
    params = SamplingParams(1.0)
    plain = decode_one(MockStepModel(VOCAB, fn), PROMPT, 24, params, seed=3).tokens
    greedy_only = CostModel({"greedy": Curve([1, 64], [1.0, 1000.0], [0.0, 0.0])})  # nothing but plain steps pay
    result = decode_one(MockStepModel(VOCAB, fn), PROMPT, 24, params, LookaheadConfig(3, 3, 3), seed=3,
                        cost=greedy_only)
    assert result.tokens == plain and set(result.step_sizes[: budget.EXPLORE_EVERY]) == {1}


def test_a_noisy_curve_is_fitted_monotone_and_one_stray_pass_does_not_move_it():
    """The AMD EPYC knots of issue 30 (t(2) slower than t(8)) are noise: the fit never falls as T grows, so a larger
    step never looks cheaper than a smaller one; and of three repeats, one stray slow pass is the median's outlier."""
    epyc = {1: 0.061, 2: 0.154, 4: 0.105, 8: 0.098, 18: 0.150}
    curve = fit([(t, 0, s) for t, s in epyc.items()])
    costs = [curve.predict(t, 0) for t in range(1, 19)]
    assert all(a <= b + 1e-12 for a, b in zip(costs, costs[1:], strict=False))
    assert curve.predict(1, 0) == pytest.approx(0.061) and curve.predict(18, 0) == pytest.approx(0.150)
    assert curve.predict(2, 0) == pytest.approx((0.154 + 0.105 + 0.098) / 3)  # the violators pooled
    stray = fit([(t, 0, s) for t in (1, 8) for s in ((0.05, 0.05, 0.5) if t == 8 else (0.04, 0.04, 0.04))])
    assert stray.predict(8, 0) == pytest.approx(0.05)
    falling = Curve([1, 4], [1.0, 2.0], [0.0, 0.0])
    for _ in range(30):
        falling.observe(4, 0, 0.5)  # observed far cheaper than a one-token step: pooled, never below it
    assert falling.predict(4, 0) >= falling.predict(1, 0)


def test_nondecreasing_is_the_least_squares_fit():
    from lookahead.tuning.curve import nondecreasing

    assert nondecreasing([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert nondecreasing([5, 4, 3]) == [4, 4, 4]
    assert nondecreasing([1, 2, 3]) == [1, 2, 3]


# ---- pinned by hand mutation (issue 28 item 10): each test fails for one mutant that the tests above let through ----


def test_a_lookahead_step_only_as_good_as_plain_is_not_taken():
    """Ties go to the plain step (`>`, not `>=`): a 2-token step that costs two one-token steps and expects two
    tokens gains nothing."""
    cost = CostModel({"greedy": Curve([1, 2], [1.0, 2.0], [0.0, 0.0])})
    chooser = StepBudget(LookaheadConfig(), cost)
    (choice,) = chooser.choose([[1.0]], 3, [0])  # calibrated worth 1.0: E = 2 for t = 2, as plain's E = 1 for t = 1
    assert choice.plain


def test_one_token_steps_move_only_their_own_knot():
    """Contention slows one-token steps less than multi-token ones: a one-token step's time says nothing of theirs."""
    curve = fit([(t, 0, 1.0 + 0.1 * t) for t in (1, 2, 4, 8)])
    before = [curve.predict(t, 0) for t in (2, 4, 8)]
    for _ in range(10):
        curve.observe(1, 0, 0.5)  # faster plain steps (a quieter moment): only knot 1 follows
    assert [curve.predict(t, 0) for t in (2, 4, 8)] == before and curve.predict(1, 0) < 1.0


def test_a_cost_that_falls_with_the_cache_length_is_noise():
    """Two lengths whose timings say a longer cache is cheaper: the cost per position is 0, never negative or
    flipped, and the base is what the shorter length measured."""
    curve = fit([(1, 0, 0.05), (1, 1000, 0.04), (4, 0, 0.06), (4, 1000, 0.07)])
    assert curve.per_position[0] == 0.0 and curve.base[0] == pytest.approx(0.05)
    assert curve.per_position[1] == pytest.approx(1e-5)


def test_the_cost_per_position_is_made_monotone_too():
    """A larger step never costs less per cached position: the per-position list is pooled like the base."""
    curve = Curve([1, 8], [1.0, 2.0], [2e-5, 1e-5])
    assert curve.per_position == pytest.approx([1.5e-5, 1.5e-5])
