"""HistoSpec: index, drafter, length control, gate, history store, and losslessness."""
from __future__ import annotations

import gzip
import json
import logging
import time
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rhymerl import LLM, SamplingParams
from rhymerl.drafting import HistoryStore, build_proposer
from rhymerl.drafting.draft_width import best_width, expected_accepted, uniform_width
from rhymerl.drafting.gate_estimates import AcceptanceEstimate
from rhymerl.drafting.length_policy import additive, multiplicative
from rhymerl.drafting import suffix_index, suffix_reference
from rhymerl.engine.cost_model import CostModel
from rhymerl.engine.draft import as_batch
from rhymerl.engine.sampler import sampling_logprobs, uniforms
from tests.helpers import tiny_model


IMPLS = pytest.mark.parametrize("impl", ["compiled", "reference"])


def _impl(name: str):
    if name == "reference":
        return suffix_reference
    from rhymerl.drafting import _suffix_core

    return _suffix_core


def test_the_compiled_core_is_built():
    """`pip install` builds it; without it drafting falls back to the (slow) Python reference."""
    assert suffix_index.COMPILED


@IMPLS
def test_suffix_index_backs_off_to_longest_match(impl):
    core = _impl(impl)
    idx = core.SuffixIndex()
    idx.add([1, 2, 3, 4, 5, 6, 7])
    idx.add([9, 9, 3, 4, 5, 8])
    m = idx.match([0, 2, 3, 4, 5], max_match=7)  # "2 3 4 5" matches only the first
    assert m.match == 4 and m.next_tokens() == [6]
    m = idx.match([7, 7, 3, 4, 5], max_match=7)  # only "3 4 5": both continue
    assert m.match == 3 and sorted(m.next_tokens()) == [6, 8]
    assert idx.match([1, 1, 1], 7) is None
    assert idx.match([1, 2, 3, 4, 5], max_match=7, min_match=6) is None
    with pytest.raises(ValueError, match="token id 2097152 is outside"):
        idx.add([1, 1 << 21])


@IMPLS
def test_live_sequence_end_is_not_a_match_but_grows(impl):
    core = _impl(impl)
    idx = core.SuffixIndex()
    sid = idx.add([1, 2, 3], final=False)
    assert idx.match([1, 2, 3], 7) is None  # the growing end has no continuation yet
    idx.append(sid, [0, 4, 1, 2, 3], 1)
    assert idx.size(sid) == 7 and idx.tokens(sid) == [1, 2, 3, 4, 1, 2, 3]
    m = idx.match([4, 1, 2, 3], 7)
    assert m.match == 3 and m.next_tokens() == [4]
    # the batch call reads each row's context from the end of its output, then its prompt
    got = core.match_batch([idx, None, idx], [[2, 3], [1, 2, 3], []], [[9, 1], [], [4, 1, 2, 3]], 7)
    assert got[0].next_tokens() == [4] and got[1] is None and got[2].next_tokens() == [4]


@IMPLS
def test_draft_path_follows_heaviest_branch_and_stops_below_min_prob(impl):
    core = _impl(impl)
    idx = core.SuffixIndex()
    for seq in ([5, 6, 7, 1, 2, 3], [5, 6, 7, 1, 2, 4], [5, 6, 7, 1, 9, 9], [5, 6, 7, 8]):
        idx.add(seq)
    occ = idx.match([5, 6, 7], 7)
    (toks, probs), = core.draft_paths([occ], [10], 0.1)
    # 1 (3/4), 2 (2/3 of those), then 3 vs 4 split: 0.75 * 0.667 * 0.5 = 0.25 >= 0.1
    assert toks[:2] == [1, 2] and probs[0] == pytest.approx(0.75) and probs[1] == pytest.approx(0.5)
    assert core.draft_paths([occ, occ], [10, 1], 0.6) == [([1], [0.75]), ([1], [0.75])]


@IMPLS
def test_drafts_carry_each_tokens_support(impl):
    """Beside each token's path probability, the weight of the continuations its context had:
    what tells a token four responses agree on from one a single response shows."""
    core = _impl(impl)
    idx = core.SuffixIndex()
    for seq in ([5, 6, 7, 1, 2, 3], [5, 6, 7, 1, 2, 4], [5, 6, 7, 1, 9, 9], [5, 6, 7, 8]):
        idx.add(seq)
    lone = core.SuffixIndex()
    lone.add([5, 6, 7, 3, 3], 2.0)
    for tree_budget, supports in ((0, [[4, 3, 2], [2, 2]]), (6, [[4, 3, 4, 3, 2, 2], [2, 2]])):
        *_, probs, support = core.longest_match_drafts([[idx, lone]], [True], [False], [[5, 6, 7]] * 2, [[], []],
                                                       [3, 2], 7, 3, 0.1, tree_budget)
        got = [[float(x) for x in row[row > 0]] for row in support]
        assert got == supports, (tree_budget, got)
        assert probs.shape == support.shape
    assert core.longest_match_drafts([[idx]], [True], [False], [[5, 6, 7]], [[]], [3], 7, 3, 0.1, 0,
                                     with_probs=False)[5:] == (None, None)


@IMPLS
def test_draft_tree_best_first_under_budget(impl):
    core = _impl(impl)
    idx = core.SuffixIndex()
    for seq in ([5, 6, 7, 1, 2], [5, 6, 7, 1, 3], [5, 6, 7, 4, 2]):
        idx.add(seq)
    occ = idx.match([5, 6, 7], 7)
    (toks, parents, probs), = core.draft_trees([occ], [3], [4], 0.1)
    assert toks[0] == 1 and parents[0] == -1 and probs[0] == pytest.approx(2 / 3)
    assert len(toks) == 3 and sorted(probs, reverse=True) == probs
    assert set(zip(toks, parents)) <= {(1, -1), (4, -1), (2, 0), (3, 0), (2, 1)}


@IMPLS
def test_pooled_and_picked_matches(impl):
    core = _impl(impl)
    a, b = core.SuffixIndex(), core.SuffixIndex()
    a.add([1, 2, 3, 4, 1, 2, 3, 5])
    b.add([1, 2, 3, 6])
    ma, mb = a.match([1, 2, 3], 3), b.match([1, 2, 3], 3)
    assert (ma + mb).next_tokens() == [4, 5, 6] and (ma + mb).match == 3
    assert ma.most_recent().next_tokens() == [5]
    picked = core.Matches.of_tokens([[7, 8], [7, 9]], 4)
    assert picked.match == 4 and core.draft_paths([picked], [4], 0.0) == [([7, 8], [1.0, 0.5])]
    del a  # pooled matches keep their indices alive
    assert core.draft_paths([ma + mb], [2], 0.0)[0][0] == [4, 1]


@settings(max_examples=60, deadline=None)
# Short sequences over 6 tokens, or long ones over 2 (a gram with more than the 64 occurrences
# a query visits: the newest 64, oldest first, in both).
@given(seqs=st.lists(st.one_of(st.lists(st.integers(0, 5), min_size=0, max_size=30),
                               st.lists(st.integers(0, 1), min_size=100, max_size=160)), min_size=1, max_size=8),
       finals=st.lists(st.booleans(), min_size=8, max_size=8),
       weights=st.lists(st.sampled_from([1.0, 0.5, 2.0, 1.25]), min_size=8, max_size=8),
       contexts=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=12), min_size=1, max_size=6),
       max_match=st.integers(3, 10), min_match=st.integers(1, 5), cap=st.integers(0, 8),
       min_prob=st.sampled_from([0.0, 0.1, 0.3]), budget=st.integers(1, 12))
def test_compiled_core_equals_the_reference(seqs, finals, weights, contexts, max_match, min_match, cap,
                                            min_prob, budget):
    """Same matches, same drafts, same probabilities (to the bit) on random indices."""
    from rhymerl.drafting import _suffix_core

    out = {}
    for core in (_suffix_core, suffix_reference):
        idx = core.SuffixIndex()
        for s, f, w in zip(seqs, finals, weights):
            idx.add(s[: len(s) // 2], w, f)
        for sid, s in enumerate(seqs):  # and grown in place
            idx.append(sid, s, len(s) // 2)
        found = core.match_batch([idx] * len(contexts), contexts, [[]] * len(contexts), max_match, min_match)
        ms = [m for m in found if m is not None]
        pooled = [m + m for m in ms]
        other = core.SuffixIndex()  # a second source: pooled on ties, or a fallback
        for s in seqs[::-1]:
            other.add(s, 1.0, True)
        rows = len(contexts)
        per_source = [[idx] * rows, [other if r % 2 else None for r in range(rows)], [found[0]] * rows]
        caps = [cap if r % 3 else 0 for r in range(rows)]  # and rows with no room
        rule = [[a.tolist() for a in core.longest_match_drafts(
                    per_source, [True, merge, False], [False, fb, True], contexts, [[1, 2]] * rows, caps,
                    max_match, min_match, min_prob, tb)]
                for merge in (True, False) for fb in (True, False) for tb in (0, budget)]
        out[core] = (rule, [None if m is None else (m.match, m.next_tokens()) for m in found],
                     core.draft_paths(ms + pooled, [cap] * 2 * len(ms), min_prob),
                     core.draft_trees(ms + pooled, [budget] * 2 * len(ms), [cap] * 2 * len(ms), min_prob),
                     [m.most_recent().next_tokens() for m in ms])
    assert out[_suffix_core] == out[suffix_reference]


def test_length_policies():
    assert additive(2, 2, 2) == 4 and additive(30, 30, 30) == 32 and additive(8, 8, 3) == 2
    assert multiplicative(4, 4, 4) == 8 and multiplicative(16, 16, 16) == 16 and multiplicative(8, 8, 2) == 4
    assert multiplicative(1, 1, 0) == 1


@pytest.mark.parametrize("policy,first", [("additive", 2), ("multiplicative", 2), ("longest", 12)])
def test_a_new_rows_first_draft_has_its_policys_start_length(policy, first):
    """`longest` has no ramp: a row's first draft (the one right after prefill, a large share of
    a short response) is as long as the history allows, not the ramps' start of 2."""
    from rhymerl.drafting import SpecConfig
    from rhymerl.engine.sequence import Sequence

    d = build_proposer(SpecConfig(sources=["prompt_history"], gate=False, length_policy=policy, index_draft_tokens=12))
    d.store.add("k", [5, 6, 7], [list(range(1, 40))], step=1)
    s = Sequence(0, 0, [5, 6, 7], SamplingParams(max_tokens=50), seed=0, prompt_key="k")
    s.output_ids, s.limit = [1, 2, 3], 50
    (draft,) = list(d.propose([s]))
    assert draft.tokens == tuple(range(4, 4 + first))


def test_gate_speculates_less_when_compute_bound():
    # cost grows with width at batch 64, barely at batch 1 (the shape measured on a CPU)
    table = {}
    for B, slope in ((1, 0.02), (64, 0.25)):
        for T in (1, 2, 3, 5, 9, 17, 33):
            table[(B, T)] = B * 0.0001 * (1 + slope * (T - 1)) if B > 1 else 0.001 * (1 + slope * (T - 1))
    cost = CostModel(table)
    assert best_width(cost, [16], 0.8, 16) >= 8
    assert best_width(cost, [16] * 64, 0.3, 16) <= 2
    assert best_width(cost, [16] * 64, 0.3, 16) < best_width(cost, [16], 0.3, 16)
    assert expected_accepted(0.5, 2) == pytest.approx(0.75)
    est = AcceptanceEstimate(prior=0.5, prior_weight=2, decay=1.0)
    est.update([4, 4], [4, 1])  # 5 successes, 1 failure
    assert est.alpha == pytest.approx(6 / 8)
    est = AcceptanceEstimate(prior=0.6, prior_weight=4, decay=0.9)
    est.update([8] * 10, [0] * 10)  # a bad patch...
    low = est.alpha
    for _ in range(50):
        est.update([], [])  # ...then no drafts: the estimate drifts back to the prior
    assert low < 0.2 and est.alpha == pytest.approx(0.6, abs=0.05)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 128), st.integers(0, 40), st.floats(0.0, 1.0), st.sampled_from([1, 3, 8, 16, 32]),
       st.floats(1.0, 2.0), st.floats(0.0, 0.01), st.floats(0.0, 0.6))
def test_uniform_width_is_best_width_for_equal_drafts(B, n, alpha, max_k, overhead, draft_s, slope):
    """The pre-drafting check's shortcut gives best_width's answer to the float."""
    table = {(b, t): b * 1e-4 * (1 + slope * (t - 1)) + 1e-3 for b in (1, 16, 128) for t in (1, 2, 3, 5, 9, 17, 33)}
    cost = CostModel(table)
    assert uniform_width(cost, B, n, alpha, max_k, overhead, draft_s) == \
        best_width(cost, [n] * B, alpha, max_k, overhead, draft_s)


def test_cost_tables_are_measured_once_per_process_and_key():
    from rhymerl.engine.cost_model import calibrated

    calls = []

    def measure(scale):
        calls.append(scale)
        return CostModel({(b, t): scale * b * t for b in (1, 4) for t in (1, 2)})

    key = ("test-only", object())  # a key no engine uses
    a = calibrated(key, lambda: measure(1.0))
    b = calibrated(key, lambda: measure(2.0))
    assert calls == [1.0] and a.table == b.table and a is not b and a.table is not b.table
    calibrated((*key, "other"), lambda: measure(3.0))
    assert calls == [1.0, 3.0]


def test_calibration_times_a_dear_batch_at_its_ends_and_interpolates_between():
    """A forward of ``affine_from_s`` or more is timed at the widest width too, and the widths
    between are interpolated: a large model calibrates in seconds, and the estimate keeps the
    forward's fixed cost (scaling the last timed width by tokens prices a row 30 % too dear here)."""
    from rhymerl.engine.cost_model import calibrate
    from rhymerl.engine.kv_cache import KVCache
    from tests.helpers import tiny_model

    cache = KVCache(tiny_model().config, 8, 64, torch.device("cpu"), torch.float32)
    forwards = []

    def model(ids, pos, view):  # 20 ms a forward plus 4 ms a token
        forwards.append(ids.numel())
        t = time.perf_counter()
        while time.perf_counter() - t < 0.02 + 0.004 * ids.numel():
            pass

    cost = calibrate(model, cache, torch.device("cpu"), max_batch=8, max_width=17, context=8, affine_from_s=0.05)
    timed = {b: {t for bb, t in cost.table if bb == b} for b in (1, 2, 4, 8)}
    # widths are timed until a forward reaches 50 ms, then only the widest
    assert timed == {1: {1, 2, 3, 5, 9, 17}, 2: {1, 2, 3, 5, 17}, 4: {1, 2, 17}, 8: {1, 17}}
    assert cost.cost(4, 5) == pytest.approx(0.02 + 0.004 * 20, rel=0.1)
    assert cost.cost(8, 9) == pytest.approx(0.02 + 0.004 * 72, rel=0.1)
    assert sum(forwards) < 1000  # every width at every batch: at least 4 x 37 x 15 = 2,220 tokens


def test_step_overhead_compares_like_batches():
    from rhymerl.drafting.gate_estimates import StepOverhead

    cost = CostModel({(b, t): 0.001 * b * t for b in (1, 4, 64) for t in (1, 2, 3, 5)})
    ov = StepOverhead(decay=0.0)
    ov.update(cost, 64, 1, 0.064 * 1.0)  # plain steps at batch 64 run as predicted
    ov.update(cost, 4, 5, 0.020 * 3.0)  # speculative steps at batch 4 run 3x slower than the forward
    assert ov.factor(64) == 1.0 and ov.factor(4) == 1.0  # no like-for-like evidence yet
    ov.update(cost, 4, 1, 0.004 * 1.5)  # plain steps at batch 4 carry 1.5x fixed overhead
    assert ov.factor(4) == pytest.approx(2.0)


def test_realized_cost_holds_off_a_source_set_that_measured_dearer_than_plain():
    from rhymerl.drafting.gate_estimates import HoldRule, RealizedCost

    cost = CostModel({(b, t): 0.001 * b for b in (1, 16, 128) for t in (1, 2, 5)})
    r = RealizedCost(decay=0.0, max_age=3, margin=1.1, rule=HoldRule(evidence=1, backoff=2, max_backoff=4))
    assert not r.needs_plain(16) and r.allows(16, 0)  # nothing measured: draft
    r.update(cost, 16, 40, 0.016 * 3.0, option=0)  # 2.5 tokens a row for 3x the time: 1.2 per token
    assert r.needs_plain(16) and not r.needs_plain(128)  # drafting ran here, plain decoding never did
    r.update(cost, 16, 16, 0.016, option=None)  # plain: 1.0 per token
    assert not r.needs_plain(16)
    r.update(cost, 16, 40, 0.016 * 3.0, option=0)  # dearer than plain: held for 2 of its steps...
    assert [r.allows(16, 0) for _ in range(3)] == [False, False, True]
    assert r.allows(16, 1) and r.allows(128, 0)  # ...that set, in that bucket only
    r.update(cost, 16, 40, 0.016 * 3.0, option=0)  # confirmed: the hold doubles (to the cap)
    assert [r.allows(16, 0) for _ in range(5)] == [False] * 4 + [True]
    r.update(cost, 16, 40, 0.016 * 3.0, option=0)  # held for 4 steps again...
    r.skip(16, 3)  # ...three of them quiet ones (the gate asked no set)
    assert [r.allows(16, 0) for _ in range(2)] == [False, True]
    r.update(cost, 16, 40, 0.016 * 2.0, option=0)  # 0.8 per token: cheaper, no hold
    assert r.allows(16, 0)
    r.update(cost, 16, 40, 0.016 * 3.0, option=0)
    r.lift({1})  # what set 1 drafts from changed: set 0 stays held
    assert not r.allows(16, 0)
    r.lift({0})  # set 0's sources changed: no hold, and the next measurement replaces the old one
    assert r.allows(16, 0)
    r.update(cost, 16, 40, 0.016 * 2.0, option=0)
    assert r.spec[(5, 0)] == pytest.approx(0.8) and r.allows(16, 0)
    for _ in range(4):  # plain decoding not measured for max_age steps: measure it again
        r.update(cost, 16, 40, 0.016 * 2.0, option=0)
    assert r.needs_plain(16)
    back = RealizedCost()
    back.load(r.state())
    assert back.plain == r.plain and back.spec == r.spec and back.dearer == r.dearer and r.dearer
    careful = RealizedCost(decay=0.0, margin=1.1)  # the default rule: one slow step holds nothing
    careful.update(cost, 16, 16, 0.016, option=None)
    careful.update(cost, 16, 40, 0.016 * 3.0, option=0)
    assert careful.allows(16, 0)
    careful.update(cost, 16, 40, 0.016 * 2.65, option=0)  # 1.06 per token: within the margin
    assert careful.allows(16, 0)
    careful.update(cost, 16, 40, 0.016 * 3.0, option=0)
    assert not careful.allows(16, 0)
    strict = RealizedCost(decay=0.0)  # the default margin: never slower, so any measured loss holds
    strict.update(cost, 16, 16, 0.016, option=None)
    for _ in range(2):
        strict.update(cost, 16, 40, 0.016 * 2.6, option=0)  # 1.04 per token: 4 % slower than plain
    assert not strict.allows(16, 0)
    # a set whose tries are dear (a model's) is held longer, up to its own cap
    dear = RealizedCost(decay=0.0, rule=HoldRule(backoff=2, max_backoff=4))
    dear.update(cost, 16, 16, 0.016, option=None)
    holds = []
    for _ in range(5):
        dear.update(cost, 16, 40, 0.016 * 3.0, option=0, rule=HoldRule(evidence=1, backoff=2, max_backoff=16))
        holds.append(dear._hold[(5, 0)])
    assert holds == [2, 4, 8, 16, 16]


def test_an_index_gate_that_never_skips_at_a_full_batch_measures_plain_decoding_there():
    """At a full batch the check before drafting may say yes on every step, so no plain step
    is ever measured there; the gate takes one, and then leaves off a verify that measured
    dearer per token (on SmolLM2 at 64 in flight it had drafted on, 0.93x of plain decoding)."""
    from rhymerl.drafting.gate import Gate

    cost = CostModel({(b, t): 0.001 * b for b in (1, 64, 128) for t in (1, 2, 3, 5)})  # verifying looks free
    gate = Gate(enabled=True, cap=4, max_nodes=5, set_names=[{"index"}], runs_model=[False], reads_history=[True])
    gate.cost_model = cost
    gate.begin(history_changed=False)
    gate.admit(("history",), ("history",))

    def drafting_step() -> None:
        assert gate.judge([4] * 64, 256, 1e-4, found=True) > 1
        gate.observe_drafts(64, succ=32, fail=64, emitted=96)  # 1.5 tokens a row...
        gate.observe_time(64, 5, 0.064 * 3.0, 0.0)  # ...for 3x a plain step's time

    assert gate.choose(64) is not None
    drafting_step()
    assert gate.choose(64) is None  # one plain step, to measure what drafting is compared with
    gate.observe_plain(64)
    gate.observe_time(64, 1, 0.064, 0.0)
    # measured against it, a verify at 3x the time for 1.5 tokens a row is not drafted again
    assert all(gate.choose(64) is None for _ in range(8))


def test_history_store_caps_and_persistence(tmp_path, caplog):
    st = HistoryStore(max_rollouts=2, max_total_tokens=40, tokenizer_fingerprint="abc")
    st.add("p1", [9, 9, 9, 9, 9, 9, 1], [[1, 2, 3], [1, 2]], step=0, rewards=[1.0, 0.0])
    st.add("p1", [9, 1], [[4, 5]], step=1)
    st.add("p1", [9, 1], [[6]], step=2)
    assert [r.step for r in st.prompts["p1"].rollouts] == [1, 2]  # oldest out
    assert st.prompts["p1"].prompt_tail == [9, 1]
    st.add("p2", [3], [[7] * 36], step=3)  # over the total cap: oldest rollouts go first
    assert st.total_tokens <= 40 and "p2" in st
    st.save(tmp_path / "h.json.gz")
    back = HistoryStore.load(tmp_path / "h.json.gz", tokenizer_fingerprint="abc")
    assert back.lengths("p2") == [36] and back.total_tokens == st.total_tokens
    with caplog.at_level(logging.WARNING):
        assert len(HistoryStore.load(tmp_path / "h.json.gz", tokenizer_fingerprint="xyz")) == 0
        assert "another tokenizer" in caplog.text
    doc = json.loads(gzip.open(tmp_path / "h.json.gz", "rt").read())
    assert "\"step\":3" in doc["body"]
    doc["body"] = doc["body"].replace("\"step\":3", "\"step\":4", 1)
    with gzip.open(tmp_path / "bad.json.gz", "wt") as f:
        f.write(json.dumps(doc))
    with caplog.at_level(logging.WARNING):
        assert len(HistoryStore.load(tmp_path / "bad.json.gz")) == 0
        assert "checksum" in caplog.text
    (tmp_path / "junk.json.gz").write_bytes(b"not gzip")
    assert len(HistoryStore.load(tmp_path / "junk.json.gz")) == 0


# --- losslessness ----------------------------------------------------------------------
PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [1, 5, 1, 5, 1], [9, 8, 7, 6, 5, 4], [11, 12]]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def _is_float_tie(model, prompt, out, pos, sp: SamplingParams, sample: int, tol: float = 1e-5) -> bool:
    """Was the token at ``pos`` decided by a float tie? Recompute that position's
    distribution from scratch (no cache) and check whether the seeded uniform lies within
    ``tol`` of a CDF boundary (sampling), or the top two logits within ``tol`` (greedy)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out[:pos]]))[0, -1:]
    if sp.temperature == 0:
        top = logits[0].topk(2).values
        return bool(top[0] - top[1] < tol)
    logp = sampling_logprobs(logits, torch.tensor([sp.temperature]), torch.tensor([sp.top_p]),
                             torch.tensor([sp.top_k]))
    cdf = logp.double().exp().cumsum(-1)[0]
    u = uniforms(torch.tensor([sp.seed]), torch.tensor([sample]), torch.tensor([pos]))[0]
    return bool(((cdf - u * cdf[-1]).abs() < tol).any())


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, -1), (1.0, 1.0, -1), (0.7, 0.9, -1),
                                                      (1.3, 1.0, 8)])
@pytest.mark.parametrize("tree_budget", [0, 8])
def test_speculation_emits_identical_tokens(temperature, top_p, top_k, tree_budget):
    model = tiny_model(std=0.25)
    keys = [f"p{i}" for i in range(len(PROMPTS))]
    base = LLM(model, max_num_seqs=16, max_model_len=96)
    store = HistoryStore(max_rollouts=2)
    for ep in range(2):  # history: two previous epochs, as RL would have
        sp = SamplingParams(n=4, temperature=max(temperature, 0.8), max_tokens=40, ignore_eos=True, seed=100 + ep)
        for k, p, o in zip(keys, PROMPTS, base.generate(PROMPTS, sp, use_tqdm=False)):
            store.add(k, p, [c.token_ids for c in o.outputs], ep)
    sp = SamplingParams(n=4, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=40, ignore_eos=True,
                        seed=7)
    plain = base.generate(PROMPTS, sp, use_tqdm=False)
    spec = LLM(model, max_num_seqs=16, max_model_len=96,
               speculative=build_proposer({"method": "history", "gate": False, "tree_budget": tree_budget}, store))
    fast = spec.generate(PROMPTS, sp, prompt_keys=keys, use_tqdm=False)
    assert spec.engine.stats.accepted > 0, "the test must exercise accepted drafts"
    ties = 0
    for p, a, b in zip(PROMPTS, plain, fast):
        for ca, cb in zip(a.outputs, b.outputs):
            if ca.token_ids != cb.token_ids:
                pos = _first_diff(ca.token_ids, cb.token_ids)
                assert _is_float_tie(model, p, ca.token_ids, pos, sp, ca.index), (p, ca.index, pos)
                ties += 1
    assert ties <= 1


def test_sampled_distribution_agrees_chi_square():
    """Unseeded sampling: the distribution of drafted positions is the target's."""
    torch.manual_seed(0)
    model = tiny_model(std=0.12, vocab_size=6)  # a flat-ish distribution over 6 tokens
    prompt = [1, 2, 3, 4]
    store = HistoryStore()
    # one stored response per possible first token: every sample gets drafts at positions 1-3
    store.add("k", prompt, [[t, 1, 1, 1] for t in range(6)] + [[t, 1, 2, 2] for t in range(6)], 0)
    n = 1500
    sp = SamplingParams(n=n, temperature=1.0, max_tokens=4, ignore_eos=True)
    plain = LLM(model, max_num_seqs=512, max_model_len=16, seed=1).generate([prompt], sp, use_tqdm=False)[0]
    spec_llm = LLM(model, max_num_seqs=512, max_model_len=16, seed=2,
                   speculative=build_proposer({"method": "history", "gate": False, "min_prob": 0.0,
                                               "sources": ["prompt_history", "global_history"]}, store))
    spec = spec_llm.generate([prompt], sp, prompt_keys=["k"], use_tqdm=False)[0]
    assert spec_llm.engine.stats.drafted > 2 * n and spec_llm.engine.stats.accepted > 100
    for pos in (1, 2, 3):  # positions reached through drafts
        a = torch.bincount(torch.tensor([c.token_ids[pos] for c in plain.outputs]), minlength=6).double()
        b = torch.bincount(torch.tensor([c.token_ids[pos] for c in spec.outputs]), minlength=6).double()
        keep = (a + b) > 0
        a, b = a[keep], b[keep]
        expected_a = (a + b) / 2
        chi2 = (((a - expected_a) ** 2) / expected_a + ((b - expected_a) ** 2) / expected_a).sum()
        df = keep.sum().item() - 1
        p_value = torch.special.gammaincc(torch.tensor(df / 2.0), chi2 / 2).item()
        assert p_value > 0.001, (pos, chi2.item(), p_value)


def _rows(drafts, n: int) -> list:
    """A proposer's drafts as one tree (or None) per row."""
    batch = as_batch(drafts)
    return [None] * n if batch is None else list(batch)


def test_gate_recovers_after_an_epoch_without_history():
    """A first epoch without history must not switch drafting off for the epochs after it."""
    from rhymerl.drafting import SpecConfig
    from rhymerl.engine.sequence import Sequence

    table = {(b, t): 0.001 * (1 + 0.05 * (t - 1)) for b in (1, 8) for t in (1, 2, 3, 5, 9, 17)}
    d = build_proposer(SpecConfig(sources=["prompt_history", "global_history"]))
    d.attach_cost_model(CostModel(table))
    seqs = []
    for i in range(8):
        s = Sequence(i, 0, [5, 6, 7], SamplingParams(max_tokens=50), seed=0, prompt_key=f"k{i}")
        s.output_ids, s.limit = [1, 2, 3], 50
        seqs.append(s)
    for _ in range(50):  # epoch 1: nothing to draft from
        assert as_batch(d.propose(seqs)) is None
    d.begin(2)
    for i in range(8):
        d.store.add(f"k{i}", [5, 6, 7], [[1, 2, 3, 4, 5, 6, 7, 8]], step=1)
    drafts = list(d.propose(seqs))
    assert all(x is not None and x.tokens[:2] == (4, 5) for x in drafts)


def test_gate_backs_off_drafting_that_keeps_finding_nothing():
    """Drafting work that the gate throws away step after step (a first epoch) is retried at
    doubling intervals, not every few steps; a new rollout step tries again at once."""
    from rhymerl.drafting import SpecConfig
    from rhymerl.engine.sequence import Sequence

    table = {(b, t): 0.001 * (1 + 0.05 * (t - 1)) for b in (1, 8) for t in (1, 2, 3, 5, 9, 17)}
    d = build_proposer(SpecConfig(sources=["prompt_history", "global_history"]))
    d.attach_cost_model(CostModel(table))
    asked = []  # drafting steps: each brings the sources' indices up to date first
    d.sources[0].sync = lambda: asked.append(1)
    seqs = []
    for i in range(8):
        s = Sequence(i, 0, [5, 6, 7], SamplingParams(max_tokens=50), seed=0, prompt_key=f"k{i}")
        s.output_ids, s.limit = [1, 2, 3], 50
        seqs.append(s)
    for _ in range(100):
        assert as_batch(d.propose(seqs)) is None
    assert 2 <= len(asked) <= 10  # 57 without the back-off
    d.begin(2)
    for i in range(8):
        d.store.add(f"k{i}", [5, 6, 7], [[1, 2, 3, 4, 5, 6, 7, 8]], step=1)
    assert all(x is not None for x in list(d.propose(seqs)))


def test_quiet_steps_after_a_no_cost_nothing_and_are_accounted_for_at_once():
    """Where the check before drafting says no, the next QUIET steps at that batch size do no
    gate work and are not measured; what they would have drifted is applied when the gate
    looks again (as many single steps would have), and another batch size looks at once."""
    from rhymerl.drafting import SpecConfig
    from rhymerl.drafting.gate import QUIET
    from rhymerl.engine.sequence import Sequence

    table = {(b, t): 0.001 * b * (1 + 0.9 * (t - 1)) for b in (1, 8) for t in (1, 2, 3, 5, 9, 17)}
    d = build_proposer(SpecConfig(sources=["prompt_history"]))
    d.attach_cost_model(CostModel(table))  # verification dear: the check says no
    seqs = []
    for i in range(8):
        s = Sequence(i, 0, [5, 6, 7], SamplingParams(max_tokens=50), seed=0, prompt_key=f"k{i}")
        s.output_ids, s.limit = [1, 2, 3], 50
        seqs.append(s)
    d.begin(1)
    d.gate.acceptance.succ, d.gate.acceptance.fail = 0.5, 3.5  # a first epoch's poor acceptance...
    d.gate._fill = 0.25  # ...and short drafts
    measured = []
    d.gate.realized.update = lambda *a, **k: measured.append(a[1])
    assert as_batch(d.propose(seqs)) is None and d.gate._quiet == QUIET
    d.observe(seqs, [0] * 8, [0] * 8)
    d.observe_time(8, 1, 0.01)
    fill, alpha = d.gate._fill, d.gate.acceptance.alpha
    for _ in range(QUIET):
        assert as_batch(d.propose(seqs)) is None
        d.observe(seqs, [0] * 8, [0] * 8)
        d.observe_time(8, 1, 0.01)
    assert measured == [8] and d.gate._idle == QUIET and (d.gate._fill, d.gate.acceptance.alpha) == (fill, alpha)
    succ, fail = d.gate.acceptance.succ, d.gate.acceptance.fail
    d.gate._wake()
    one = build_proposer(SpecConfig(sources=["prompt_history"]))  # the same steps one at a time
    one.gate._fill, one.gate.acceptance.succ, one.gate.acceptance.fail = fill, succ, fail
    for _ in range(QUIET):
        one.gate._skip(4)
        one.gate.acceptance.add(0, 0)
    assert d.gate._fill == pytest.approx(one.gate._fill, rel=1e-12) and d.gate._fill > fill
    assert d.gate.acceptance.alpha == pytest.approx(one.gate.acceptance.alpha, rel=1e-12) and d.gate.acceptance.alpha > alpha
    d.propose(seqs)
    d.observe(seqs, [0] * 8, [0] * 8)
    d.observe_time(8, 1, 0.01)
    assert measured == [8, 8]  # awake: measured again
    assert as_batch(d.propose(seqs[:4])) is None and d.gate._idle == 0  # another batch size: a look at once


@pytest.mark.parametrize("fallback", [True, False])
def test_global_fallback_drafts_from_other_prompts(fallback):
    """A prompt without history (or without a match in it) drafts from other prompts' responses."""
    from rhymerl.drafting import SpecConfig
    from rhymerl.engine.sequence import Sequence

    sources = ["prompt_history", "global_history"] if fallback else ["prompt_history"]
    d = build_proposer(SpecConfig(sources=sources, gate=False))
    d.store.add("a", [5, 6, 7], [[11, 12, 13, 14, 15, 16]], step=1)
    d.store.add("b", [5, 6, 7], [[20, 21, 22, 23]], step=1)
    s = Sequence(0, 0, [8, 9], SamplingParams(max_tokens=50), seed=0, prompt_key="new")
    s.output_ids, s.limit, s.draft_len = [11, 12, 13], 50, 4
    (draft,) = _rows(d.propose([s]), 1)
    if fallback:
        assert draft is not None and draft.tokens[:3] == (14, 15, 16)
    else:
        assert draft is None
    # its own history, matching as long, wins over the others'
    d.store.add("new", [8, 9], [[11, 12, 13, 30, 31]], step=1)
    (draft,) = _rows(d.propose([s]), 1)
    assert draft is not None and draft.tokens[0] == 30


def test_the_index_over_every_prompt_appends_new_rollouts_without_a_pass_over_the_store():
    """A rollout recorded while a vLLM engine runs (every few steps) is appended from the store's
    log of additions, not by a pass over every prompt stored; a store whose contents were
    replaced, or whose log was cut past the index's cursor, is read whole."""
    from rhymerl.drafting.history_sources import GlobalHistorySource
    from rhymerl.drafting.source import SourceContext
    from rhymerl.drafting import SpecConfig

    class NoPass(dict):
        def items(self):
            raise AssertionError("a pass over every prompt")

    store = HistoryStore(max_rollouts=1)
    for i in range(50):
        store.add(f"p{i}", [1, i], [[i, i + 1, i + 2]], step=1)
    src = GlobalHistorySource(SourceContext(SpecConfig(), store, None, None))
    assert src.index() is not None and src._tokens == 150
    store.prompts = NoPass(store.prompts)
    store.add("new", [1, 2], [[7, 8, 9, 10]], step=1)
    store.add("p3", [1, 3], [[4, 4]], step=2)  # a prompt's next epoch (its first is dropped: one kept)
    src.index()
    assert src._tokens == 156 and src._steps["p3"] == 2
    store.prompts = dict(store.prompts)
    other = HistoryStore(max_rollouts=1)
    other.add("q", [1], [[5, 6]], step=1)
    cursor = store.log_end()
    store.replace_with(other)
    assert store.added_since(cursor) is None  # replaced: read whole
    for step in range(3, 3000):  # one prompt, many epochs: the log is cut, the store stays small
        store.add("q", [1], [[5, 6]], step=step)
    assert len(store._log) < 2000 and store.added_since(cursor + 5) is None
    assert store.added_since(store.log_end() - 1) == [("q", 2999)]


def test_siblings_draft_from_tokens_emitted_and_requests_admitted_since_the_last_step():
    """Live indices follow the sequences' outputs and are brought up to date once per
    drafting step (``sync``); requests admitted later get their own."""
    from rhymerl.drafting import SpecConfig
    from rhymerl.engine.sequence import Sequence

    d = build_proposer(SpecConfig(sources=["siblings"], gate=False))

    def seq(rid: int, idx: int, prompt: list[int]) -> Sequence:
        s = Sequence(rid, idx, prompt, SamplingParams(n=2, max_tokens=50), seed=0)
        s.limit, s.draft_len = 50, 4
        return s

    a, b = seq(0, 0, [5, 6, 7]), seq(0, 1, [5, 6, 7])
    seqs = [a, b]
    d.on_admit(seqs)
    assert _rows(d.propose(seqs), 2) == [None, None]
    a.output_ids += [10, 11, 12, 13, 14]
    b.output_ids += [10, 11]
    assert _rows(d.propose(seqs), 2)[1].tokens[:3] == (12, 13, 14)
    c, e = seq(1, 0, [8, 9]), seq(1, 1, [8, 9])
    d.on_admit([c, e])
    seqs += [c, e]
    c.output_ids += [20, 21, 22, 23]
    e.output_ids += [20, 21]
    assert _rows(d.propose(seqs), 4)[3].tokens[:2] == (22, 23)


def test_a_situation_where_drafting_did_not_pay_sleeps_but_one_rollout_in_probe_every():
    """Across rollouts: where drafting was tried and accepted under UNPAID_SHARE of the tokens
    (a prompt's first epoch, siblings alone), the next rollouts in the same situation draft
    nothing and skip the sources' bookkeeping, except one in PROBE_EVERY; history for the
    prompt makes another situation (awake), and the memory survives a checkpoint."""
    from rhymerl.drafting import SpecConfig
    from rhymerl.drafting.gate import PROBE_EVERY, UNPAID_TRIES
    from rhymerl.engine.sequence import Sequence

    d = build_proposer(SpecConfig(sources=["prompt_history", "siblings"]))
    siblings = d.sources[1]

    def rollout(step: int, tries: int, accepted: int) -> bool:
        d.begin(step)
        seqs = []
        for i in range(4):
            s = Sequence(step, i, [5, 6, 7], SamplingParams(n=4, max_tokens=50), seed=i, prompt_key="p")
            s.output_ids, s.limit = [1, 2, 3], 50
            seqs.append(s)
        d.on_admit(seqs)
        dormant = d.gate._dormant
        assert (siblings._live == {}) == dormant  # a dormant rollout's sequences are not indexed
        if dormant:
            assert as_batch(d.propose(seqs)) is None and d.gate._rows == 0
        else:  # what the rollout's drafting came to
            d.gate._tries, d.gate._rows, d.gate._accepted = tries, 1000, accepted
        for s in seqs:
            d.on_finish(s)
        assert siblings._live == {}
        return dormant

    assert not rollout(1, UNPAID_TRIES, 9)  # tried, under 1 % accepted
    slept = [rollout(2 + i, UNPAID_TRIES, 9) for i in range(3 * PROBE_EVERY)]
    # each probe that finds it still unpaid doubles the period: probes are dear
    assert slept == [True] * (PROBE_EVERY - 1) + [False] + [True] * (2 * PROBE_EVERY - 1) + [False]
    state = d.gate_state()
    d.store.add("p", [5, 6, 7], [[1, 2, 3, 4]], step=1)  # the prompt's own history: another situation
    assert not rollout(40, UNPAID_TRIES, 200)
    assert not rollout(41, UNPAID_TRIES, 9)  # tried there, and it did not pay either...
    assert rollout(42, 0, 0)  # ...so that one sleeps too
    fresh = build_proposer(SpecConfig(sources=["prompt_history", "siblings"]))
    fresh.load_gate_state(state)
    assert fresh.gate._unpaid == {("siblings",): 0} and fresh.gate._period == {("siblings",): 2 * PROBE_EVERY}
    # a probe that finds drafting paying ends the sleep; unpaid again, it starts from PROBE_EVERY
    sit = ("prompt_history", "siblings")
    for i in range(PROBE_EVERY):
        if not rollout(50 + i, UNPAID_TRIES, 200):
            break
    assert not rollout(90, UNPAID_TRIES, 9) and sit not in d.gate._unpaid
    d.begin(91)
    assert d.gate._unpaid[sit] == 0 and d.gate._period[sit] == PROBE_EVERY


def test_bucket_acceptance_is_optimistic_where_unmeasured_and_settles_on_evidence():
    """A batch size never verified at plans above the global estimate (so it is tried once);
    its own evidence then decides, whatever the other batch sizes accepted; a rollout step
    forgets half of it."""
    from rhymerl.drafting.gate_estimates import BucketAcceptance

    b = BucketAcceptance()
    b.add(3, 60, 40)  # the drained tail: 0.6
    assert b.alpha(8, 0.6) > 0.8  # the full batch, never measured: tried
    b.add(8, 930, 70)  # ...where drafts turn out to be accepted at 0.93
    assert 0.92 < b.alpha(8, 0.6) < 0.95
    assert b.alpha(3, 0.6) < 0.7
    b.add(7, 0, 300)  # evidence against is as decisive
    assert b.alpha(7, 0.9) < 0.05
    before = b.alpha(7, 0.9)
    b.relax(0.5)
    assert (b.evidence[7].succ, b.evidence[7].fail) == (0.0, 150.0) and b.alpha(7, 0.9) > before
    back = BucketAcceptance()
    back.load(b.state())  # a checkpoint's round trip
    assert back.state() == b.state() and back.alpha(3, 0.6) == b.alpha(3, 0.6)


def test_drafts_accepted_but_dearer_than_plain_on_the_whole_also_sleep():
    """A rollout whose verified drafts from a model were accepted but measured dearer per token
    than plain decoding where most of its verifications were (RealizedCost's verdicts) did not
    pay either; where most verifications paid it stays awake."""
    from rhymerl.drafting import SpecConfig
    from rhymerl.drafting.gate import UNPAID_TRIES
    from rhymerl.engine.sequence import Sequence

    def rollout(d, step: int, verified: set, spec: float, tries: int = UNPAID_TRIES, judged: bool = True) -> bool:
        d.gate._guarded = model if isinstance(model, list) else [model]  # as if sets ran a model (the rule is for those)
        d.begin(step)
        s = Sequence(step, 0, [5, 6, 7], SamplingParams(max_tokens=50), seed=0, prompt_key="p")
        s.output_ids, s.limit = [1, 2, 3], 50
        d.on_admit([s])
        dormant = d.gate._dormant
        if not dormant:
            d.gate._tries, d.gate._rows, d.gate._accepted = tries, 1000, 300  # 23 % of the tokens accepted
            d.gate._verified = Counter(verified)
            for b, o in d.gate._verified:
                d.gate.realized.plain[b] = 1.0
                d.gate.realized.spec[(b, o)] = spec if b == 8 else 1.5
                if judged:  # RealizedCost judged it (a fresh plain measurement, enough evidence)
                    d.gate.realized.dearer[(b, o)] = d.gate.realized.spec[(b, o)] > d.gate.realized.margin
        d.on_finish(s)
        return dormant

    model = True
    dear = build_proposer(SpecConfig(sources=["siblings"]))
    assert not rollout(dear, 1, {(8, 0), (3, 0)}, 1.5)
    assert rollout(dear, 2, set(), 0.0)
    cheap = build_proposer(SpecConfig(sources=["siblings"]))
    assert not rollout(cheap, 1, {(8, 0): 3, (3, 0): 1}, 0.8)  # paid at the full batch, where most were
    assert not rollout(cheap, 2, set(), 0.0)
    even = build_proposer(SpecConfig(sources=["siblings"]))
    assert not rollout(even, 1, {(8, 0): 1, (3, 0): 3}, 1.0)  # broke even in one bucket, dearer in most
    assert rollout(even, 2, set(), 0.0)
    # one try is enough for the verdict (a model's tries are held long: a rollout makes few)
    few = build_proposer(SpecConfig(sources=["siblings"]))
    assert not rollout(few, 1, {(8, 0)}, 1.5, tries=1)
    assert rollout(few, 2, set(), 0.0)
    unjudged = build_proposer(SpecConfig(sources=["siblings"]))  # measured, never judged: no verdict
    assert not rollout(unjudged, 1, {(8, 0)}, 1.5, tries=1, judged=False)
    assert not rollout(unjudged, 2, set(), 0.0)
    none = build_proposer(SpecConfig(sources=["siblings"]))  # no verification: nothing learnt
    assert not rollout(none, 1, set(), 0.0, tries=1) and not rollout(none, 2, set(), 0.0)
    model = False  # cheap index sources: their holds act per bucket, the rollout stays awake
    index = build_proposer(SpecConfig(sources=["siblings"]))
    assert not rollout(index, 1, {(8, 0), (3, 0)}, 1.5) and not rollout(index, 2, set(), 0.0)
    model = [True, False]  # a hybrid: a set with the model (dearer) and the index sources alone
    hybrid = build_proposer(SpecConfig(sources=["siblings"]))
    assert not rollout(hybrid, 1, {(8, 0): 2, (8, 1): 5}, 1.5)  # most drafts were the index sources'
    assert not rollout(hybrid, 2, {(8, 0): 5, (8, 1): 2}, 1.5)  # not settled yet: the verdict is at the next
    assert rollout(hybrid, 3, set(), 0.0)
