"""The engine's host-side hot paths against the per-row code they replaced (issue 36): the step budget's choice over
every (row, node) slot, and the packed step's numbers, on random inputs. Each reference is the old implementation,
kept here as it was."""

from __future__ import annotations

import heapq
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import MockStepModel, decode_one
from lookahead import LookaheadConfig, host_loops
from lookahead.drafts import (
    ROOT,
    DraftBuilder,
    DraftMemory,
    DraftTree,
    NGramPool,
    RecycleTables,
    Sources,
    SuffixIndex,
    preorder,
)
from lookahead.drafts.builder import (
    _MISSING,
    _NONE,
    _POOL_STATES,
    _RANKED,
    _RANKED_PROBABILITY,
    _SUFFIX_STATES,
    EDGE_PROBABILITY,
    NO_RECYCLE,
    SUFFIX_LIMIT,
    SUFFIX_REACH,
    _compiled,
    stronger,
)
from lookahead.drafts.edges import pool_state, suffix_state
from lookahead.drafts.suffix import _SCAN, SEPARATOR
from lookahead.drafts.tree import BestFirst
from lookahead.kernels import StepPattern
from lookahead.loop import full_pattern, pack_step
from lookahead.loop.core import Output
from lookahead.loop.verify import Verdict, verify
from lookahead.models.programs import PackedOutput, Packing, slot_run
from lookahead.tuning import CostModel, Curve, StepBudget, budget
from lookahead.tuning.budget import EXPLORE_EVERY, NOTHING_FIXED, Choice, Fixed

REPO = Path(__file__).resolve().parents[1]


class HeapBudget(StepBudget):
    """`StepBudget` with its choice as it was: a heap of each row's next node, every option's taken list kept."""

    def _rate(self, tokens: int, length: int, expected: float) -> tuple[float, float]:
        """(expected tokens per second, seconds) of a step of `tokens` tokens over mean cache length `length`."""
        seconds = self.cost.predict(self.round_up(tokens), length, self.kind) + self.host
        return expected / seconds, seconds

    def choose(self, scores: Sequence[Sequence[float]], branch: int | Sequence[int], lengths: Sequence[int],
               fixed: Fixed = NOTHING_FIXED) -> list[Choice]:
        """Each lookahead row's size for the next step. scores: each row's draft node scores, best first (a prefix
        of a best-first tree is a tree); branch: the lookahead branch's tokens per row (W times the window's levels;
        carried only when `self.branch`), one for all rows or each row's own; lengths: each row's cache length L; fixed:
        the rest of the step.

        The step takes (row, node) slots in decreasing calibrated worth (a row's node only after its parent, so each
        row's share is a prefix of its draft), and of every count of slots keeps the one that maximises the whole
        step's expected tokens per second, (expected tokens) / (t(tokens, L) + h), against every lookahead row
        decoding plainly. At most one step in `EXPLORE_EVERY` explores (`_explore`)."""
        rows = len(scores)
        branches = [branch] * rows if isinstance(branch, int) else list(branch)
        carries = branches if self.branch else [1] * rows  # each row's tokens before its nodes
        base_tokens, base_expected = fixed.tokens + sum(carries), fixed.expected + rows
        # the step's mean cache length, with every row at its base size: what each added slot's attention reads on
        # average (a slot of a longer row reads more; a second-order effect the choice ignores)
        length = (fixed.weight + sum(n * c for n, c in zip(lengths, carries, strict=True))) // max(base_tokens, 1)
        plain = self._rate(fixed.tokens + rows, length, base_expected)
        best_rate, best_taken = plain, None
        taken = [0] * rows
        worth = [self._worths(row) for row in scores]  # the calibrated worth of each row's n-th node
        heads = [(-w[0], r) for r, w in enumerate(worth) if w]  # each row's next node
        heapq.heapify(heads)
        tokens, expected = base_tokens, base_expected
        options = [(self._rate(tokens, length, expected), list(taken), tokens, expected)] if self.branch else []
        while heads:
            value, r = heapq.heappop(heads)
            taken[r] += 1
            tokens, expected = tokens + 1, expected - value
            if taken[r] < len(worth[r]):
                heapq.heappush(heads, (-worth[r][taken[r]], r))
            options.append((self._rate(tokens, length, expected), list(taken), tokens, expected))
        lookahead = max(options, key=lambda option: option[0][0], default=None)
        if lookahead is not None and lookahead[0][0] > best_rate[0]:
            best_rate, best_taken = lookahead[:2]
        self.since_explored += 1
        if self.since_explored >= EXPLORE_EVERY:
            explore = self._explore(options, length, plain[1] - self.host, best_rate[0])
            if explore is not None and explore[1] != best_taken:
                best_rate, best_taken = explore[:2]
                self.since_explored, self.explored = 0, self.explored + 1
        if best_taken is None:
            return [Choice(0, False, 0, 1, 1.0, best_rate[1]) for _ in scores]
        return [Choice(n, self.branch, n, carry + n, 1 + self.calibrated(sum(row[:n])), best_rate[1])
                for n, row, carry in zip(best_taken, scores, carries, strict=True)]

    def _explore(self, options: list, length: int, plain_seconds: float, best: float) -> tuple | None:
        """The option to run instead of the best one, to measure a stale knot again: the smallest whose step would
        run a knot no step ran lately and that would beat the best rate were it only as dear as the knots run lately
        allow (a larger step never costs less than a smaller one, nor than the plain step). None where there is none:
        a size known to be dear, or one that could not win, is not worth a step."""
        runs: dict[int, tuple] = {}  # per stale knot (smallest first): the option of its size, else the fullest
        for option in options:
            size = self.round_up(option[2])
            knot = self.cost.stale_knot(size, self.kind)
            if knot is not None and (knot not in runs or size == knot or self.round_up(runs[knot][2]) != knot):
                runs[knot] = option  # options come in growing size: the last kept is the fullest
        for option in runs.values():
            size = self.round_up(option[2])
            least = max(self.cost.floor(size, length, self.kind), plain_seconds) + self.host
            if option[3] / least > best:
                return option
        return None


    def _worths(self, scores: Sequence[float]) -> list[float]:
        worths, total, before = [], 0.0, 0.0
        for score in scores:
            total += score
            now = self.calibrated(total)
            worths.append(now - before)
            before = now
        return worths


def random_scores(rng: random.Random, rows: int, most: int) -> list[list[float]]:
    out = []
    for _ in range(rows):
        score, row = rng.random(), []
        for _ in range(rng.randint(0, most)):
            score *= rng.choice([1.0, 1.0, rng.random()])  # ties, as products of equal edges give
            row.append(score)
        out.append(row)
    return out


def budgets(rng: random.Random, static: bool):
    """Two budgets in the same random state: the new one and the heap one."""
    knots = sorted(rng.sample(range(2, 300), 4))
    base = sorted(rng.uniform(1e-3, 2e-2) for _ in knots)
    curve = [1, *knots], [base[0] * 0.8, *base], [rng.choice([0.0, 1e-7])] * 5
    rounding = (lambda t: 1 if t == 1 else -(-t // 16) * 16) if static else None
    made = []
    for cls in (StepBudget, HeapBudget):
        cost = CostModel({"greedy": Curve(*(list(x) for x in curve))})
        chooser = cls(LookaheadConfig(4, 5, 30), cost, static=static, round_up=rounding)
        made.append(chooser)
    seed = rng.random()
    for chooser in made:  # the same calibration, host time and exploration history
        state = random.Random(seed)
        chooser.expected = [state.uniform(0, 20) for _ in chooser.expected]
        chooser.accepted = [state.uniform(0, 20) for _ in chooser.accepted]
        chooser.host = state.choice([0.0, 1e-4])
        chooser.cost.curves["greedy"].observed = state.randint(0, 100)
    return made


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("static", [False, True], ids=["exact", "static"])
@pytest.mark.parametrize("seed", range(40))
def test_the_budget_chooses_what_the_heap_scan_chose(seed, static, compiled, monkeypatch):
    if compiled:
        assert host_loops.load() is not None, "the compiled host loops did not build"
    rng = random.Random(seed)
    new, old = budgets(rng, static)
    new.compiled = compiled
    for step in range(12):  # exploration comes every EXPLORE_EVERY steps: both must agree on when and what
        rows = rng.randint(1, 40)
        scores = random_scores(rng, rows, rng.choice([3, 15, 120]))
        branch = [rng.choice([4, 8, 16]) for _ in range(rows)] if rng.random() < 0.5 else 16
        lengths = [rng.randint(0, 4000) for _ in range(rows)]
        fixed = rng.choice([NOTHING_FIXED, Fixed(rng.randint(1, 64), rng.uniform(0, 8), rng.randint(0, 10**5))])
        got, want = new.choose(scores, branch, lengths, fixed), old.choose(scores, branch, lengths, fixed)
        assert got == want, (seed, step)
        assert (new.since_explored, new.explored) == (old.since_explored, old.explored)


def test_merged_slots_are_the_heap_order():
    rng = random.Random(0)
    for _ in range(300):
        worths = [[rng.choice([0.5, 0.25, rng.random()]) for _ in range(rng.randint(0, 12))]
                  for _ in range(rng.randint(1, 6))]
        heap = [(-w[0], r) for r, w in enumerate(worths) if w]
        heapq.heapify(heap)
        taken, want = [0] * len(worths), []
        while heap:
            value, r = heapq.heappop(heap)
            want.append((r, -value))
            taken[r] += 1
            if taken[r] < len(worths[r]):
                heapq.heappush(heap, (-worths[r][taken[r]], r))
        order, gains = budget.merge_slots(worths)
        assert list(zip(order, gains, strict=True)) == want


def test_compiled_slots_are_the_merged_worths_bit_for_bit():
    """`host_loops.slots` (what the budget takes its slots from) against `merge_slots` of each row's `_worths`, on
    scores with ties within a row and between rows (two rows alike: the lower row first), zeros, sums on the
    calibration bands' bounds, empty rows and no rows."""
    assert host_loops.load() is not None, "the compiled host loops did not build"
    rng = random.Random(6)
    budget_ = budgets(rng, False)[0]
    for i in range(300):
        scores = random_scores(rng, rng.randint(0, 12), rng.choice([3, 15, 40])) if i else []
        scores += [[0.25, 0.25, 0.5, 0.0, 1.0]] if rng.random() < 0.3 else []
        if scores and rng.random() < 0.5:  # a row twice, the copy somewhere after it: every run of the two ties
            scores.insert(rng.randint(1, len(scores)), list(rng.choice(scores)))
        calibration = budget_._calibration()
        want = budget.merge_slots([budget_._worths(row, calibration) for row in scores])
        assert host_loops.load().slots(scores, budget.CALIBRATION_BANDS, *calibration) == want


def test_predict_many_is_predict_bit_for_bit():
    rng = random.Random(1)
    for knots in ([1], [1, 16], [1, 8, 32, 64, 512]):
        curve = Curve(list(knots), sorted(rng.uniform(1e-4, 1e-2) for _ in knots), [rng.uniform(0, 1e-6)] * len(knots))
        tokens = [rng.randint(1, 700) for _ in range(200)] + list(range(1, 600))
        for length in (0, 17, 3000):
            assert curve.predict_many(tokens, length) == [curve.predict(t, length) for t in tokens]  # numpy
            short = tokens[:20]  # the Python loop
            assert curve.predict_many(short, length) == [curve.predict(t, length) for t in short]



def test_stale_knots_are_stale_knot_of_each():
    rng = random.Random(2)
    for knots in ([1], [1, 16], [1, 8, 32, 64, 512]):
        curve = Curve(list(knots), sorted(rng.uniform(1e-4, 1e-2) for _ in knots), [0.0] * len(knots))
        curve.observed = 40
        curve.ran = [rng.choice([None, 0, 30]) for _ in knots]
        tokens = [rng.randint(1, 700) for _ in range(200)] + list(range(1, 600))
        assert curve.stale_knots(tokens) == [curve.stale_knot(t) for t in tokens]  # numpy
        short = tokens[:20]  # the Python loop
        assert curve.stale_knots(short) == [curve.stale_knot(t) for t in short]


def random_tree_end(rng: random.Random, nodes: int) -> tuple[int, ...]:
    parents: list[int] = []
    for j in range(nodes):
        parents.append(rng.choice([-1, *range(j)]))
    return DraftTree.grown(list(range(nodes)), parents).tree_end


def test_position_list_is_relative_positions():
    rng = random.Random(3)
    for _ in range(200):
        window, ngram = rng.randint(1, 6), rng.randint(2, 6)
        if rng.random() < 0.3:
            pattern = StepPattern(window, ngram, rng.randint(0, 5))
        else:
            tree_end = tuple(random_tree_end(rng, rng.randint(0, 40)))
            pattern = StepPattern(window, ngram, tree_end=tree_end)
            assert StepPattern.of_tree(window, ngram, tree_end) == pattern
        assert list(pattern.position_list) == pattern.relative_positions.tolist()


def test_slot_runs_are_the_table_look_ups():
    rng = random.Random(4)
    for _ in range(200):
        size = rng.choice([1, 4, 16])
        blocks = rng.sample(range(1000), 12)
        start = rng.randint(0, size * 6)
        count = rng.randint(0, size * 6 - 1)
        assert slot_run(blocks, size, start, count) == [blocks[p // size] * size + p % size
                                                          for p in range(start, start + count)]


def test_packed_outputs_are_each_rows_logits_rows_argmax_and_top_k():
    """`Packing.outputs` hands each row its logits lazily (`PackedOutput`): read, they are the step's logits rows at
    the row's places, as the eager unpacking took them (a run of rows as a view, any other places gathered); its
    argmax and top-k are the fetched array's."""
    rng = random.Random(5)
    for _ in range(100):
        h, k = rng.randint(1, 24), rng.choice([0, 3])
        logits = torch.randn(h, 11)
        host = torch.cat([logits.argmax(-1), logits.topk(k, dim=-1).indices.flatten()]).numpy() if k else \
            logits.argmax(-1).numpy()
        packing = Packing.__new__(Packing)  # only what `outputs` reads: the steps, their places, no sampling
        packing.steps, packing.heads, packing.samples = [], [], {}
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(1, h)
            first = rng.randrange(h - n + 1)
            places = list(range(first, first + n)) if rng.random() < 0.5 else [rng.randrange(h) for _ in range(n)]
            t = rng.randint(1, h)
            top_start = rng.randrange(h - t + 1) if k and rng.random() < 0.7 else -1
            packing.steps.append(SimpleNamespace(tokens=[0] * t, sample=None))
            packing.heads.append((places, top_start))
        outputs = packing.outputs(logits, host, k)
        for step, (places, top_start), out in zip(packing.steps, packing.heads, outputs, strict=True):
            assert isinstance(out, PackedOutput)
            assert out.argmax == logits.argmax(-1)[places].tolist()
            assert torch.equal(out.logits, logits[torch.tensor(places)])
            if places == list(range(places[0], places[0] + len(places))):
                assert out.logits.data_ptr() == logits[places[0]].data_ptr()  # a view: no copy
            if top_start < 0:
                assert out.topk is None
            else:
                want = logits.topk(k, dim=-1).indices[top_start : top_start + len(out.topk)]
                assert len(out.topk) == len(step.tokens)
                assert torch.equal(out.topk, want)
            assert out.sampled is None


def old_accept(out, tokens, fed=None):
    """`Output.accept` as it was: token by token, the limit checked before each."""
    result = out.result
    result.steps += 1
    if fed is not None:
        result.step_sizes.append(fed)
    taken = []
    for token in tokens:
        if len(result.tokens) + len(taken) == out.max_new_tokens:
            break
        taken.append(token)
        if token in out.stop or (out.stops_at is not None and out.stops_at(token)):
            out.done = True
            result.finish_reason = "stop"
            break
    result.tokens.extend(taken)
    result.step_tokens.append(taken)
    if not out.done and len(result.tokens) >= out.max_new_tokens:
        out.done = True
        result.finish_reason = "length"
    return taken


@pytest.mark.parametrize("seed", range(10))
def test_output_accepts_as_it_did(seed):
    """The same tokens taken, the same finish, and `stops_at` (which keeps state: a stop string's detector) asked
    about the same tokens in the same order."""
    rng = random.Random(seed)
    for _ in range(50):
        limit, stop = rng.randint(1, 12), set(rng.sample(range(20), rng.randint(0, 3)))
        stop_after = rng.choice([None, rng.randint(1, 15)])
        outs, asked = [], []
        for _ in range(2):
            seen = []

            def stops_at(token, seen=seen, after=stop_after):  # a stop string ending at the `after`-th token seen
                seen.append(token)
                return len(seen) == after

            outs.append(Output(limit, stop, None, stops_at if stop_after is not None else None))
            asked.append(seen)
        new, old = outs
        while not new.done:
            tokens = [rng.randrange(20) for _ in range(rng.randint(1, 6))]
            fed = rng.choice([None, len(tokens) + 2])
            assert new.accept(tokens, fed) == old_accept(old, tokens, fed)
            assert (new.done, new.result) == (old.done, old.result)
        assert old.done and asked[0] == asked[1]


class OldSuffixIndex(SuffixIndex):
    """`SuffixIndex` with its look-up as it was: every occurrence of each match length gathered before any is taken."""

    def continuations(self, limit: int, length: int,
                      tail: Sequence[int] | None = None) -> list[tuple[tuple[int, ...], int]]:
        """Up to `limit` distinct continuations (at most `length` tokens) of earlier occurrences of the
        sequence's suffix (or of `tail`'s, looked up in this index), with the suffix length matched (up to
        `reach`): longest match first, then most recent first."""
        seq = self.tokens
        n = len(seq)
        out: list[tuple[tuple[int, ...], int]] = []
        if tail is None:  # the sequence's own suffix: not a match of itself
            tail, longest, itself = seq, min(self.max_match, n - 1), self.start + n - 1
        else:
            longest, itself = min(self.max_match, len(tail)), None
        if limit <= 0 or length <= 0 or longest < 1:
            return out
        taken: set[tuple[int, ...]] = set()
        used: set[int] = set()
        for m in range(longest, 0, -1):
            found = []
            # a frequent token can have hundreds of occurrences whose continuations repeat: look at a few
            for end in reversed(self._ends.get(tuple(tail[len(tail) - m :]), ())[-_SCAN * limit :]):
                if end == itself or end in used:  # the suffix itself; an occurrence already taken by a longer match
                    continue
                used.add(end)
                i = end + 1 - self.start
                continuation = tuple(seq[i : i + length])
                if SEPARATOR in continuation:  # the next text is not what followed
                    continuation = continuation[: continuation.index(SEPARATOR)]
                if continuation:
                    found.append((continuation, self._matched(tail, end, m)))
            if m == self.max_match:  # the longest indexed: measured further back, longest first (sort is stable)
                found.sort(key=lambda item: -item[1])
            for continuation, matched in found:
                if continuation not in taken:
                    taken.add(continuation)
                    out.append((continuation, matched))
                    if len(out) == limit:
                        return out
        return out


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("seed", range(20))
def test_suffix_continuations_are_what_they_were(seed, compiled):
    """The look-up (the compiled loop, and the Python one it replaces where it cannot be built) against the reference,
    on texts joined by separators, the first forgotten in some (positions then start past 0)."""
    if compiled:
        assert host_loops.load() is not None, "the compiled host loops did not build"
    rng = random.Random(seed)
    vocab = rng.choice([3, 8, 50])
    texts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in range(3)]
    new, old = SuffixIndex(4, 16), OldSuffixIndex(4, 16)
    new.compiled, old.compiled = compiled, False  # (the reference grows by the Python loop)
    forget = rng.random() < 0.5
    for index in (new, old):
        for text in texts:
            index.extend([SEPARATOR, *text] if index.tokens else text)
        if forget:
            index.forget(len(texts[0]))
    for _ in range(50):
        limit, length = rng.randint(0, 6), rng.randint(0, 20)
        tail = None if rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        assert new.continuations(limit, length, tail) == old.continuations(limit, length, tail)
        step = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        new.extend(step)
        old.extend(step)
        assert (new.tokens, list(new._ends.items()), new._run) == (old.tokens, list(old._ends.items()), old._run)


class OldDraftBuilder(DraftBuilder):
    """`DraftBuilder` with its growth as it was: every proposed path inserted whole into a trie before growing, each
    node's children offered by the general path (`_children`)."""

    def grow(self, sequence: Sequence[int], pool: NGramPool, budget: int) -> BestFirst:
        """Up to `budget` nodes under the input token `sequence[-1]` in best-first order, with their scores: any
        prefix of it is the best tree of its size."""
        if budget <= 0:
            return BestFirst([], [], [])
        proposals: dict = {}  # token -> [children, suffix state, pool state]: the paths proposed whole
        memory = self.memory
        if self.use_suffix:
            for continuation, match in self.suffix.continuations(SUFFIX_LIMIT, budget):
                _insert(proposals, continuation, 1, suffix_state(match, False), suffix_state(match, True))
            if memory is not None:
                for continuation, match in memory.continuations(sequence[-SUFFIX_REACH:], SUFFIX_LIMIT, budget):
                    _insert(proposals, continuation, 1, suffix_state(match, False, True),
                            suffix_state(match, True, True))
        if self.use_pool:
            for continuation in pool.candidates(sequence[-1], self.pool_limit):
                _insert(proposals, continuation, 2, pool_state(False), pool_state(True))
            if memory is not None:
                for continuation in memory.candidates(sequence[-1], self.pool_limit):
                    _insert(proposals, continuation, 2, pool_state(False, True), pool_state(True, True))
        previous = sequence[-2] if len(sequence) > 1 else -1
        second = sequence[-3] if len(sequence) > 2 else -1
        return self._grow(second, previous, sequence[-1], proposals, budget)

    def _grow(self, second: int, previous: int, root_token: int, proposals: dict, budget: int) -> BestFirst:
        """Best-first growth. Children of a node are sorted by edge probability, so a child is offered only
        when its elder sibling is taken: two heap pushes per node instead of one per candidate."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        heap: list = []
        offered = self._children(second, previous, root_token, proposals)
        if offered:
            heap.append((-offered[0][0], 0, ROOT, root_token, previous, 1.0, offered, 0))
        order = 1
        while heap and len(tokens) < budget:
            neg, _, parent, parent_token, grand_token, parent_score, siblings, i = heapq.heappop(heap)
            _, token, below = siblings[i]
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            scores.append(-neg)
            if i + 1 < len(siblings):
                heapq.heappush(heap, (-parent_score * siblings[i + 1][0], order, parent, parent_token, grand_token,
                                      parent_score, siblings, i + 1))
                order += 1
            offered = self._children(grand_token, parent_token, token, below)
            if offered:
                heapq.heappush(heap, (neg * offered[0][0], order, node, token, parent_token, -neg, offered, 0))
                order += 1
        return BestFirst(tokens, parents, scores)

    def _children(self, second: int, previous: int, token: int, proposed: dict | None) -> list:
        """(probability, child token, proposals below it) of every child offered under `token` (whose own previous
        tokens are `second`, `previous`), best first."""
        listed, kind = self._recycled(second, previous, token) if self.use_recycle else ((), 1)
        if not proposed:  # most nodes: recycled tokens only, their probabilities tabulated by rank
            out = list(zip(_RANKED_PROBABILITY[kind], listed, _NONE, strict=False))  # listed: <= k
        else:
            offered = {child: [None, code] for child, code in zip(listed, _RANKED[kind], strict=False)}
            missing = _MISSING[kind] if listed else NO_RECYCLE
            for child, (below, suffix, pool) in proposed.items():
                entry = offered.get(child)
                if entry is None:
                    offered[child] = [below, missing + suffix + pool]
                else:
                    entry[0] = below
                    entry[1] += suffix + pool
            out = [(EDGE_PROBABILITY[code], child, below) for child, (below, code) in offered.items()]
        out.sort(reverse=True)  # siblings are distinct tokens: ties stop at the token
        return out


def _insert(trie: dict, path: Sequence[int], slot: int, first_state: int, later_state: int) -> None:
    """Add a proposed path to the proposal trie (token -> [children, suffix state, pool state]), keeping the
    stronger state where two proposals share a node."""
    level = trie
    for depth, token in enumerate(path):
        state = first_state if depth == 0 else later_state
        entry = level.get(token)
        if entry is None:
            entry = level[token] = [{}, 0, 0]
            entry[slot] = state
        elif stronger(slot, state, entry[slot]):
            entry[slot] = state
        level = entry[0]


def test_the_proposal_state_tables_are_the_edge_states():
    """The builder's tabulated proposal states (a suffix match longer than SUFFIX_REACH scores as SUFFIX_REACH)."""
    for memory in (False, True):
        for match in range(1, 3 * SUFFIX_REACH):
            states = (suffix_state(match, False, memory), suffix_state(match, True, memory))
            assert _SUFFIX_STATES[memory][min(match, SUFFIX_REACH)] == states
        assert _POOL_STATES[memory] == (pool_state(False, memory), pool_state(True, memory))


class Ids:
    """Random token ids: 0..vocab-1, or (wide) shifted to straddle 2**21 - 2, the largest id whose recycled-table keys
    the compiled loop packs in 64 bits (past it, it makes them with Python's arithmetic)."""

    def __init__(self, rng: random.Random, wide: bool) -> None:
        self.rng, self.vocab, self.base = rng, rng.choice([6, 30, 200]), 2**21 - 4 if wide else 0

    def token(self) -> int:
        return self.base + self.rng.randrange(self.vocab)

    def tokens(self, n: int) -> list[int]:
        return [self.token() for _ in range(n)]

    def context(self, n: int) -> list[int]:
        """n tokens before a row's token in its context (-1: none)."""
        return [-1 if t < 0 else self.base + t for t in (self.rng.randrange(-1, self.vocab) for _ in range(n))]

    def distinct(self, k: int) -> list[int]:
        return [self.base + t for t in self.rng.sample(range(self.vocab), min(k, self.vocab))]


def random_builder_inputs(rng: random.Random, ids: Ids):
    sequence = ids.tokens(rng.randint(1, 200))
    memory = None
    if rng.random() < 0.6:
        memory = DraftMemory()
        for _ in range(rng.randint(1, 3)):
            text = ids.tokens(rng.randint(5, 150))
            tables, pool = RecycleTables(), NGramPool(4, 5)
            pool.add_sequence(text)
            rows = rng.randint(1, 40)
            # (the memory's rows may repeat a token: siblings then tie on probability and token)
            tables.update(ids.context(rows), ids.context(rows), ids.tokens(rows), [ids.tokens(8) for _ in range(rows)])
            memory.add(text, tables, pool)
    return sequence, memory


@pytest.mark.parametrize("wide", [False, True], ids=["ids", "wide-ids"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("seed", range(30))
def test_the_draft_tree_grows_as_it_did(seed, compiled, wide):
    """The growth (the compiled loop, and the Python loop it replaces where it cannot be built) against the reference:
    the same nodes, parents and scores, bit for bit."""
    if compiled:
        assert _compiled() is not None, "the compiled host loops did not build"
    rng = random.Random(seed)
    ids = Ids(rng, wide)
    sequence, memory = random_builder_inputs(rng, ids)
    sources = Sources(pool=rng.random() < 0.8, suffix=rng.random() < 0.8, recycle=rng.random() < 0.8)
    new = DraftBuilder(sequence, sources, pool_limit=5, memory=memory)
    new.compiled = compiled
    old = OldDraftBuilder(sequence, sources, pool_limit=5, memory=memory)
    pool = NGramPool(4, 5)
    pool.add_sequence(sequence)
    for _ in range(15):
        rows = rng.randint(1, 30)
        update = (ids.context(rows), ids.context(rows), ids.tokens(rows), [ids.distinct(8) for _ in range(rows)])
        for builder in (new, old):
            builder.recycle.update(*update)
        budget = rng.choice([0, 1, 5, 15, 120])
        assert new.grow(sequence, pool, budget) == old.grow(sequence, pool, budget)
        step = ids.tokens(rng.randint(1, 4))
        sequence += step
        new.extend(step)
        old.extend(step)
        pool.add_sequence(sequence, start=len(sequence) - len(step) - 3)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_grown_trees_are_numbered_as_the_pre_order_walk_numbers_them(compiled):
    if compiled:
        assert host_loops.load() is not None, "the compiled host loops did not build"
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(0, 60)
        parents = [rng.choice([ROOT, *range(j)]) for j in range(n)]
        tokens = [rng.randrange(1000) for _ in range(n)]
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        order, ends = preorder(children, ROOT)
        new = {old: j for j, old in enumerate(order)}
        new[ROOT] = ROOT
        tree = DraftTree.grown(tokens, parents, compiled=compiled)
        derived = StepPattern.of_tree(2, 3, tuple(tree.tree_end))  # depths from tree_end, as a pattern derives them
        assert type(tree.depths) is tuple and tree.depths == derived._depths
        given = StepPattern.of_tree(2, 3, tuple(tree.tree_end), tree.depths)
        assert given.position_list == derived.position_list == tuple(derived.relative_positions.tolist())
        assert tree == DraftTree([tokens[n] for n in order], [new[parents[n]] for n in order], ends)


def test_the_host_time_benchmark_runs_quick_and_its_oracle_replays_the_streams():
    """bench/host_time.py --quick (1 and 8 rows, 24 tokens, a worker process): it runs, checking every request's
    tokens against the recorded stream (the oracle's forward is the default model's, as recorded), and prints the
    table."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / "host_time.py"), "--quick"], capture_output=True,
                          text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("after ")]
    assert [int(r[1]) for r in rows] == [1, 8], done.stdout
    assert all(int(r[2]) >= 1 for r in rows), done.stdout  # steps measured with every row decoding


def old_learn(tables: RecycleTables, rows: list[int], parents: list[int], step_tokens: list[int], sequence: list[int],
              topk: torch.Tensor) -> None:
    """`LookaheadLoop._learn`'s table update as it was (before `RecycleTables.update_step`)."""
    parent = [*parents, -2]
    tokens = [*step_tokens, sequence[-3] if len(sequence) > 2 else -1, sequence[-2] if len(sequence) > 1 else -1]
    first = [parent[i] for i in rows]
    second = [parent[p] for p in first]
    lists = topk.tolist()
    tables.update([tokens[p] for p in second], [tokens[p] for p in first], [tokens[i] for i in rows],
                  [lists[i] for i in rows])


def table_state(tables: RecycleTables) -> list:
    """The three tables' entries in order, each value with the number of the list object it is (first seen first):
    which keys share one row's list matters to the drafting memory, which forgets a segment's entries by identity."""
    objects: dict[int, int] = {}
    return [[(key, value, objects.setdefault(id(value), len(objects))) for key, value in table.items()]
            for table in (tables.triples, tables.pairs, tables.single)]


@pytest.mark.parametrize("wide", [False, True], ids=["ids", "wide-ids"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("seed", range(10))
def test_a_step_updates_the_recycled_tables_as_it_did(seed, compiled, wide):
    if compiled:
        assert host_loops.load() is not None, "the compiled host loops did not build"
    rng = random.Random(seed)
    ids = Ids(rng, wide)
    new, old = RecycleTables(), RecycleTables()
    for _ in range(20):
        t = rng.randint(1, 40)
        parents = [-1] + [rng.randrange(i) for i in range(1, t)]  # each step token after its predecessor
        step_tokens, sequence = ids.tokens(t), ids.tokens(rng.randint(1, 3))
        rows = [rng.randrange(t) for _ in range(rng.randint(0, 2 * t))]  # repeats: the accepted path's come again
        k = rng.choice([1, 8])
        topk = torch.tensor([ids.tokens(k) for _ in range(t)], dtype=torch.int64)
        if rng.random() < 0.3:
            topk = topk.t().contiguous().t()  # strided rows, as a view of a wider array may be
        before = (sequence[-3] if len(sequence) > 2 else -1, sequence[-2] if len(sequence) > 1 else -1)
        new.update_step(rows, parents, step_tokens, before, topk, compiled=compiled)
        old_learn(old, rows, parents, step_tokens, sequence, topk)
        assert table_state(new) == table_state(old)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("parents", [[0], [-2], [-1, 1], [-1, 0, 5]], ids=str)
def test_a_grown_tree_refuses_a_parent_after_its_node(parents, compiled):
    with pytest.raises(ValueError) as raised:
        DraftTree.grown(list(range(len(parents))), parents, compiled=compiled)
    with pytest.raises(ValueError) as python:
        DraftTree.grown_python(list(range(len(parents))), parents)
    assert str(raised.value) == str(python.value)


def old_verify(tree: DraftTree, chosen: Sequence[int]) -> Verdict:
    """`verify` as it was: each node's children through `DraftTree.children`."""
    node, tokens = ROOT, []
    while True:
        want = chosen[node + 1]
        child = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if child is None:
            return Verdict(tokens + [want], node)
        tokens.append(want)
        node = child


def test_verification_walks_as_it_did():
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(0, 30)
        vocab = rng.choice([2, 4, 50])
        parents = [rng.choice([ROOT, *range(j)]) for j in range(n)]
        tree = DraftTree.grown([rng.randrange(vocab) for _ in range(n)], parents)  # (siblings may repeat a token)
        chosen = [rng.randrange(vocab) for _ in range(n + 1)]
        assert verify(tree, chosen) == old_verify(tree, chosen)


class OldPool(NGramPool):
    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> None:
        for i in range(max(start, 0), len(tokens) - self.ngram + 1):
            self.add(tokens[i : i + self.ngram])


def test_a_pool_adds_a_sequence_as_it_did():
    rng = random.Random(8)
    for _ in range(300):
        ngram, capacity = rng.randint(2, 5), rng.choice([0, 1, 3, 8])
        new, old = NGramPool(ngram, capacity), OldPool(ngram, capacity)
        tokens = [rng.randrange(rng.choice([3, 20])) for _ in range(rng.randint(0, 60))]
        for start in sorted(rng.sample(range(-3, 70), 4)):
            new.add_sequence(tokens, start)
            old.add_sequence(tokens, start)
            assert [(k, list(c)) for k, c in new._grams.items()] == [(k, list(c)) for k, c in old._grams.items()]


def test_generations_draft_the_same_without_the_compiled_loops(monkeypatch):
    """End to end on the mock model, warm: every step's tree, the tokens each step fed and accepted, and what the
    drafting memory ends up holding are the same whether the compiled loops run or the Python paths do (as where the
    build fails)."""
    assert host_loops.load() is not None, "the compiled host loops did not build"
    cfg = LookaheadConfig(2, 4, 6, budget="fixed")
    prompts = [[(5 * i + j * j) % 16 for j in range(14)] + [3, 4, 5, 3, 4, 5] for i in range(4)]

    def run() -> tuple:
        memory, seen = DraftMemory(), []
        for prompt in prompts:
            model = MockStepModel(16)
            result = decode_one(model, prompt, 40, lookahead=cfg, memory=memory)
            seen.append((result.tokens, result.step_sizes, result.step_tokens,
                         [(p.window, p.ngram, p.tree_end) for p in model.patterns]))
        tables = memory.recycle
        return seen, tables.triples, tables.pairs, tables.single, memory.suffix._ends, memory._grams.keys()

    compiled = run()
    assert any(len(set(p[2])) > 1 for p in compiled[0][-1][3] if p[2])  # trees with branches were drafted
    monkeypatch.setattr(host_loops, "load", lambda: None)
    assert run() == compiled


def test_commit_indices_are_the_path_down_to_the_verdict():
    rng = random.Random(9)
    config = LookaheadConfig(3, 4, 5)
    for _ in range(300):
        n = rng.randint(0, 15)
        tree = DraftTree.grown(list(range(n)), [rng.choice([ROOT, *range(j)]) for j in range(n)])
        layout = pack_step([[7, 8, 9]] * rng.randint(1, 3), tree, full_pattern(config), rng.random() < 0.5)
        node = rng.choice([ROOT, *range(n)])
        la = layout.pattern.lookahead_len
        assert layout.commit_indices(Verdict([1], node)) == [0, *(la + j for j in tree.path(node))]
