"""HistoSpecProposer driven as vLLM's model runner drives it, without vLLM: a stand-in runner
holds the batch's requests, and a stand-in verifier accepts the part of each draft that matches
the request's own response. What runs here is the proposer's bookkeeping: memory that stays
flat over long runs (split groups included), history it records itself, the sampler check."""
from __future__ import annotations

import random
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from rhymerl.vllm.proposer import HistoSpecProposer

VOCAB, MAX_LEN = 50, 96


class Runner:
    """What the proposer reads of vLLM's GPUModelRunner: requests, the persistent batch."""

    def __init__(self) -> None:
        self.requests: dict[str, SimpleNamespace] = {}
        self.input_batch = SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(0, dtype=np.int64))
        self.device = "cpu"


def proposer(runner: Runner, k: int = 6, **rhymerl) -> HistoSpecProposer:
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                          additional_config={"rhymerl": rhymerl},
                          model_config=SimpleNamespace(max_model_len=MAX_LEN, get_vocab_size=lambda: VOCAB))
    p = HistoSpecProposer(cfg, runner=runner)
    p._sampler_ok = True  # the stand-in verifier is exact; the probe has its own test
    return p


class Engine:
    """Requests run to their fixed responses; each step a row emits 1 token plus the drafted
    tokens that match what follows (an exact verifier of a deterministic 'model')."""

    def __init__(self, prop: HistoSpecProposer, runner: Runner, max_rows: int = 16) -> None:
        self.prop, self.runner, self.max_rows = prop, runner, max_rows
        self.live: dict[str, dict] = {}  # rid -> {prompt, target, out, draft}
        self.waiting: list[tuple[str, dict]] = []
        self.serial = 0
        self.forwards = self.tokens = 0

    def add(self, prompt: list[int], target: list[int], key: str | None, group: str, size: int, sample: int,
            temperature: float = 1.0) -> None:
        self.serial += 1
        rid = f"r{self.serial}"
        extra = {"group": group, "group_size": size, "sample": sample}
        if key is not None:
            extra["prompt_key"] = key
        self.runner.requests[rid] = SimpleNamespace(sampling_params=SimpleNamespace(
            extra_args=extra, max_tokens=len(target), temperature=temperature))
        self.waiting.append((rid, {"prompt": prompt, "target": target, "out": [], "draft": []}))

    def step(self) -> None:
        while self.waiting and len(self.live) < self.max_rows:
            rid, r = self.waiting.pop(0)
            self.live[rid] = r
        sampled = []
        for rid, r in self.live.items():
            pos, target, emit = len(r["out"]), r["target"], []
            for t in r["draft"]:  # the draft continues the tokens so far: its matching prefix
                if pos + len(emit) < len(target) and t == target[pos + len(emit)]:
                    emit.append(t)
                else:
                    break
            if pos + len(emit) < len(target):  # and the verifier's own next token
                emit.append(target[pos + len(emit)])
            r["out"] += emit
            sampled.append(emit)
            self.tokens += len(emit)
        self.forwards += len(self.live)  # row forwards: tokens per forward is per request
        rids = list(self.live)
        rows = np.zeros((max(1, len(rids)), MAX_LEN), dtype=np.int64)
        counts = []
        for i, rid in enumerate(rids):
            ids = self.live[rid]["prompt"] + self.live[rid]["out"]
            rows[i, :len(ids)] = ids
            counts.append(len(ids))
        self.runner.input_batch.req_ids = rids
        self.runner.input_batch.num_prompt_tokens = np.array([len(self.live[r]["prompt"]) for r in rids])
        drafts = self.prop.propose(sampled, counts, rows) if rids else []
        for rid, d in zip(rids, drafts):
            self.live[rid]["draft"] = list(d)
        for rid in [r for r in rids if len(self.live[r]["out"]) >= len(self.live[r]["target"])]:
            del self.live[rid]  # finished: gone from the runner before the next step
            del self.runner.requests[rid]

    def run(self) -> float:
        f0, t0 = self.forwards, self.tokens
        while self.live or self.waiting:
            self.step()
        return (self.tokens - t0) / max(1, self.forwards - f0)


def task(seed: int, prompts: int = 24):
    """Prompts whose responses rhyme across epochs: each epoch's response is the prompt's base
    response with a few tokens redrawn."""
    rng = random.Random(seed)
    base = {f"p{j}": ([rng.randrange(3, VOCAB) for _ in range(6)], [rng.randrange(3, VOCAB) for _ in range(40)])
            for j in range(prompts)}

    def epoch(e: int, j: int, sample: int) -> list[int]:
        r = random.Random(hash((seed, e, j, sample)))
        resp = list(base[f"p{j}"][1])
        for _ in range(3):
            resp[r.randrange(len(resp))] = r.randrange(3, VOCAB)
        return resp
    return base, epoch


def run_epoch(eng: Engine, base, epoch, e: int, n: int = 4, keyed: bool = True) -> float:
    for j, (key, (prompt, _)) in enumerate(base.items()):
        for i in range(n):
            eng.add(prompt, epoch(e, j, i), key if keyed else None, f"{e}:{key}", n, i)
    return eng.run()


def test_the_proposer_records_its_own_history_and_drafts_from_it_next_epoch():
    """No history file, no trainer: epochs of the same prompts, keyed by name or by a hash of
    their tokens. From the second epoch on, the proposer drafts from what it recorded (as much
    as from the same history pushed); with recording off it cannot. The cutoff is off: its
    decisions follow this stand-in engine's Python timings, not where drafts come from."""
    base, epoch = task(0)
    rates = {}
    ungated = {"speculative": {"gate": False}}
    for name, kw, keyed in (("self", {}, True), ("self_hashed", {}, False), ("off", {"record": False}, True)):
        runner = Runner()
        eng = Engine(proposer(runner, **kw, **ungated), runner)
        rates[name] = [run_epoch(eng, base, epoch, e, keyed=keyed) for e in (1, 2, 3)]
    runner = Runner()
    pushed = proposer(runner, record=False, **ungated)
    eng = Engine(pushed, runner)
    for e in (1, 2):
        pushed.put_history([(k, p, [(e, [epoch(e, j, i) for i in range(4)], [None] * 4)])
                            for j, (k, (p, _)) in enumerate(base.items())])
        rates.setdefault("pushed", []).append(run_epoch(eng, base, epoch, e + 1))
    assert rates["self"][2] > 1.5 * rates["off"][2], rates
    assert rates["self_hashed"][2] > 1.5 * rates["off"][2], rates
    assert rates["self"][2] >= 0.9 * rates["pushed"][1], rates
    assert rates["self"][0] < rates["self"][1], rates


def test_proposer_memory_stays_flat_over_a_thousand_steps_with_split_groups():
    """1,000+ steps of requests coming and going, a third of the groups arriving as a subset of
    their samples (as after a migration): per-request state stays bounded by what is live, the
    recorded history by its token budget, and the process's allocations flat."""
    runner = Runner()
    prop = proposer(runner, history_tokens=5_000, speculative={"history_epochs": 2})
    eng = Engine(prop, runner, max_rows=12)
    rng = random.Random(1)
    base, epoch = task(1, prompts=60)
    keys = list(base)
    steps, peak, mem = 0, {}, []
    tracemalloc.start()
    try:
        e = 0
        while steps < 1200:
            e += 1
            for _ in range(4):
                j = rng.randrange(len(keys))
                n = 4
                subset = range(n) if rng.random() > 0.33 else rng.sample(range(n), 2)  # a migrated subset
                for i in subset:
                    eng.add(base[keys[j]][0], epoch(e, j, i)[:rng.randrange(5, 40)], keys[j], f"{e}:{j}", n, i)
            while eng.live or eng.waiting:
                eng.step()
                steps += 1
                for k, v in prop.live_state().items():
                    peak[k] = max(peak.get(k, 0), v)
            if steps > 300:
                mem.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    runner.input_batch.req_ids = []
    prop.propose([], [], np.zeros((0, MAX_LEN), dtype=np.int64))  # the next step retires the last batch
    state = prop.live_state()
    assert state["seqs"] == state["groups"] == state["sibling_indices"] == state["recording"] == 0, state
    assert peak["seqs"] <= 12 and peak["sibling_indices"] <= 12, peak
    assert peak["history_tokens"] <= 5_000, peak
    assert max(mem) - min(mem) < 2_000_000, (min(mem), max(mem))


def test_no_drafts_at_temperature_where_the_sampler_is_not_known_correct():
    base, epoch = task(2, prompts=4)
    runner = Runner()
    prop = proposer(runner, record=True)
    eng = Engine(prop, runner)
    run_epoch(eng, base, epoch, 1)
    prop._sampler_ok = False
    assert run_epoch(eng, base, epoch, 2) == pytest.approx(1.0)  # T=1: nothing drafted
    for j, (key, (prompt, _)) in enumerate(base.items()):
        eng.add(prompt, epoch(2, j, 0), key, f"g:{key}", 1, 0, temperature=0.0)
    assert eng.run() > 1.2  # greedy requests still draft


def test_an_engine_that_dies_under_a_call_is_named_in_one_error():
    from rhymerl.vllm.watchdog import EngineLost, Watchdog

    class EngineDeadError(Exception):  # vLLM's, by name
        pass

    dog = Watchdog(lambda: [], timeout_s=30)
    try:
        with pytest.raises(EngineLost, match="engine core ended during step.*--resume"):
            with dog.call("step"):
                raise EngineDeadError("EngineCore encountered an issue")
        with pytest.raises(ValueError):  # anything else passes through
            with dog.call("step"):
                raise ValueError("x")
    finally:
        dog.close()


def _drive_cutoff(c0: float, cr: float, cd: float, accept: dict, rows: int = 64, steps: int = 600, cs: float = 0.0,
                  confident=None, **kw):
    """A DraftCutoff driven as the proposer drives it, on an engine whose step costs
    ``c0 + cr B + cd D`` (+ ``cs`` when it drafts; 5 % noise) and whose verification accepts each
    next token of a draft from source ``s`` with probability ``accept[s]`` (a callable: of the
    token's confidence); the index offers each row 8 tokens, or fewer (a short match) on one row
    in four, of confidence 1 (or ``confident(rng)``'s row). Returns the cutoff, the rows'
    sources and the share of steps after the first 100 that drafted."""
    from rhymerl.vllm.draft_cutoff import DraftCutoff

    cut, rng, k = DraftCutoff(8, **kw), random.Random(0), 8
    sources = [list(accept)[i % len(accept)] for i in range(rows)]
    drafting = 0
    for step in range(steps):
        b = rows if step % 40 < 30 else rng.randint(4, rows)  # full batches, then a drained tail
        offered = [k if rng.random() < 0.75 else rng.randint(1, k) for _ in range(b)]
        conf = np.array([confident(rng) if confident else [1.0] * k for _ in range(b)])
        keep = cut.lengths(b, sources[:b], offered, conf)
        assert all(0 <= n <= o for n, o in zip(keep, offered))
        accepted = []
        for src, n, c in zip(sources[:b], keep, conf):
            rate = accept[src] if callable(accept[src]) else (lambda _, p=accept[src]: p)
            a = 0
            while a < n and rng.random() < rate(c[a]):
                a += 1
            accepted.append(a)
        cut.observe_drafts(sources[:b], keep, accepted, conf)
        d = sum(keep)
        cut.observe_step(b, d, (c0 + cr * b + cd * d + (cs if d else 0.0)) * rng.uniform(0.95, 1.05))
        drafting += step >= 100 and d > 0
    return cut, sources, drafting / (steps - 100)


def test_the_draft_cutoff_drafts_as_far_as_tokens_pay_on_this_engine():
    """Compute-bound (a CPU: a drafted token costs half a row): a source accepted 95 % of the
    time drafts deep, one accepted 40 % not past the depth where q < margin x theta; fixed costs
    dominating (a GPU's memory-bound decode): both draft (nearly) their whole length; a drained
    tail of a compute-bound engine drafts further than its full batch."""
    cut, src, _ = _drive_cutoff(0.002, 0.0002, 0.0001, {"good": 0.95, "poor": 0.4}, cs=0.0005)
    c0, cr, cd, cs = cut.cost()
    # What the decisions read: a drafted token's cost, and whole steps' (a window of about 50
    # steps with one plain step in 16 leaves c0 and cs apart only to about half a millisecond).
    assert abs(cd - 0.0001) < 0.00003, (c0, cr, cd, cs)
    for b, d in ((64, 0), (64, 300), (16, 60)):
        true = 0.002 + 0.0002 * b + 0.0001 * d + (0.0005 if d else 0.0)
        assert abs(c0 + cr * b + cd * d + (cs if d else 0.0) - true) < 0.1 * true, (b, d, (c0, cr, cd, cs))
    theta = cut.threshold(64)  # 0.0064 / (0.002 + 0.0128): about 0.43
    assert 0.35 < theta < 0.5
    cut.steps = 1  # past the probes
    full = dict(zip(src, cut.lengths(64, src, [8] * 64, np.ones((64, 8)))))
    assert full["good"] >= 2 and full["poor"] == 0, full
    cut.steps = 1
    tail = dict(zip(src[:4], cut.lengths(4, src[:4], [8] * 4, np.ones((4, 8)))))
    assert tail["good"] >= full["good"] and tail["poor"] >= 1, (tail, full)  # theta(4) is about 0.29
    cut, src, _ = _drive_cutoff(0.030, 0.00002, 0.00002, {"good": 0.95, "poor": 0.6})
    cut.steps = 1
    cheap = dict(zip(src, cut.lengths(64, src, [8] * 64, np.ones((64, 8)))))  # theta about 0.04: q = 0.6^6 still pays
    assert cheap["good"] == 8 and cheap["poor"] >= 5, cheap


def test_the_draft_cutoff_ends_each_draft_where_its_tokens_confidence_falls():
    """Acceptance follows a token's confidence (its share of the index's continuations), not its
    position: rows whose drafts hold their confidence for a varying number of tokens keep
    exactly those, at whatever depth the confidence falls (a position-only model keeps one depth
    for all)."""
    def confident(rng):  # 1.0 for the first m tokens, then a split continuation
        m = rng.randint(1, 7)
        return [1.0] * m + [0.3] * (8 - m)

    accept = {"history": lambda c: 0.97 if c > 0.9 else 0.3}
    cut, src, _ = _drive_cutoff(0.002, 0.0002, 0.0001, accept, confident=confident)
    assert 0.35 < cut.threshold(64) < 0.5  # about 0.43, 0.47 with the margin: 0.97^m pays, 0.97^m x 0.3 does not
    cut.steps = 1  # past the probes
    rng = random.Random(5)
    conf = np.array([confident(rng) for _ in range(64)])
    keep = cut.lengths(64, src, [8] * 64, conf)
    assert keep == [int((c > 0.9).sum()) for c in conf], keep


def test_the_draft_cutoff_trusts_a_continuation_by_how_many_responses_showed_it():
    """Every token below is the only continuation its context had (a share of 1), but the first
    ``m`` were seen in sixteen responses and the rest in one, and the policy follows the lone one
    less often: each row keeps its well-attested tokens, wherever they end (with shares alone all
    look alike and every row keeps all or none)."""
    from rhymerl.vllm.draft_cutoff import token_confidence

    got = token_confidence(np.array([[1.0, 0.5, 0.0]]), np.array([[1.0, 4.0, 0.0]]))[0]
    assert got.tolist() == pytest.approx([2 / 3, 0.5, 0.0])  # (s n + 1) / (n + 2); nothing past the draft

    def attested(m):
        return token_confidence(np.ones((1, 8)), np.array([[16.0] * m + [1.0] * (8 - m)]))[0]

    accept = {"history": lambda c: 0.97 if c > 0.9 else 0.4}
    cut, src, _ = _drive_cutoff(0.002, 0.0002, 0.0001, accept, confident=lambda rng: attested(rng.randint(1, 7)))
    cut.steps = 1  # past the probes
    rng = random.Random(5)
    ms = [rng.randint(1, 7) for _ in range(64)]
    assert cut.lengths(64, src, [8] * 64, np.array([attested(m) for m in ms])) == ms


def test_a_draft_that_merely_breaks_even_is_not_drafted():
    """Drafted tokens must pay ``margin`` times their cost: at theta about 0.86 a source accepted
    90 % of the time breaks even by the fit, and drafting it on a compute-bound engine risks a
    slower step for a gain inside the fit's error."""
    for margin, drafts in ((1.0, True), (None, False)):  # None: the default margin
        cut, src, _ = _drive_cutoff(0.002, 0.0002, 0.0002, {"even": 0.9}, **({} if margin is None else {"margin": margin}))
        cut.steps = 1  # past the probes
        assert (sum(cut.lengths(64, src, [8] * 64, np.ones((64, 8)))) > 0) == drafts, (margin, cut.threshold(64), cut.acceptance("even")[-1])


@pytest.mark.parametrize("accept, cs, drafts", [
    ({"poor": 0.3}, 0.004, False),  # what the kept drafts add does not pay the drafting step's fixed cost
    ({"poor": 0.3}, 0.0, True),  # ... with no fixed cost, the tokens that pay are still drafted
    ({"good": 0.9}, 0.004, True),  # ... and good drafts pay it
])
def test_a_step_drafts_only_when_its_drafts_pay_for_the_speculative_path(accept, cs, drafts):
    """Never slower: a step whose kept drafts are expected to add less than the speculative
    path's fixed cost plus their verification runs as plain decoding (the probes aside)."""
    cut, _, share = _drive_cutoff(0.004, 0.00005, 0.00002, accept, cs=cs)
    assert (share > 0.8) if drafts else (share < 0.15), (share, cut.cost())


def test_a_probe_step_drafts_whole_lengths_on_a_rotating_share_of_the_rows():
    """Deep acceptance stays measured for every row in turn, while a probe costs a quarter of
    a whole batch's long drafts (on a compute-bound engine those drafts cost as much as rows)."""
    cut, src, _ = _drive_cutoff(0.002, 0.0002, 0.0002, {"poor": 0.6}, cs=0.0005)
    probes = []
    for lap in (1, 2):
        cut.steps = lap * cut.probe_every  # the next call is a probe
        probes.append(cut.lengths(64, src, [8] * 64, np.ones((64, 8))))
    for got in probes:
        assert sorted(set(got)) == [0, 8] and got.count(8) == 16, got  # one row in 4
    assert probes[0] != probes[1]  # another share of the rows each time
    cut.steps = 1
    assert sum(cut.lengths(64, src, [8] * 64, np.ones((64, 8)))) == 0  # between probes: not worth drafting


def test_the_draft_cutoff_drafts_everything_until_it_has_measured_the_engine():
    from rhymerl.vllm.draft_cutoff import DraftCutoff

    cut = DraftCutoff(6)
    first = [cut.lengths(32, ["siblings", None], [6, 4], np.ones((2, 6))) for _ in range(4)]  # nothing, whole, half, whole
    assert first == [[6, 4], [3, 3], [6, 4], [0, 0]] and cut.cost() is None
    for _ in range(20):  # rows and drafts never vary apart: their costs cannot be told apart
        cut.observe_step(32, 64, 0.01)
    assert cut.cost() is None


def test_a_recorded_rollout_comes_after_the_prompts_stored_ones():
    """A response recorded here is a new rollout of its prompt, labelled after the ones on file:
    it replaces the file's (one epoch kept), never merges into it as the same step."""
    from rhymerl.drafting import HistoryStore
    from rhymerl.vllm.proposer import Recorder

    store = HistoryStore(max_rollouts=1)
    store.add("p", [5, 6], [[7, 8, 9]], step=4)  # as loaded from a run's history file
    rec = Recorder(store)
    for out in ([10, 11], [12]):  # two samples of the prompt, run together
        rec.admit(SimpleNamespace(prompt_key="p", prompt_ids=[5, 6], output_ids=out))
    for out in ([10, 11], [12]):
        rec.finish(SimpleNamespace(prompt_key="p", prompt_ids=[5, 6], output_ids=out), None)
    assert [(r.step, r.responses) for r in store.prompts["p"].rollouts] == [(5, [[10, 11], [12]])]
    rec.admit(SimpleNamespace(prompt_key="q", prompt_ids=[3], output_ids=[4]))
    rec.finish(SimpleNamespace(prompt_key="q", prompt_ids=[3], output_ids=[4]), 9)  # a trainer's step
    assert store.prompts["q"].rollouts[0].step == 9


def test_the_draft_length_inside_vllm_is_vllms_num_speculative_tokens():
    """One way in: the run's index_draft_tokens goes out as num_speculative_tokens and is not
    sent again beside it; a plain vLLM program setting a different one in additional_config is refused."""
    from rhymerl.drafting import SpecConfig
    from rhymerl.vllm.methods import vllm_speculative
    from rhymerl.vllm.proposer import proposer_config

    spec, extra = vllm_speculative(SpecConfig(method="history", index_draft_tokens=7))
    assert spec["num_speculative_tokens"] == 7 and "index_draft_tokens" not in extra
    assert proposer_config(7, extra).index_draft_tokens == 7
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        proposer_config(7, {"index_draft_tokens": 12})


def _add_epoch(eng: Engine, part: dict, epoch, e: int, n: int = 4) -> None:
    for key, (prompt, _) in part.items():
        j = int(key[1:])
        for i in range(n):
            eng.add(prompt, epoch(e, j, i), key, f"{e}:{key}", n, i)


def _run_together(engines: list[Engine]) -> float:
    """Engines stepping in turn (GPUs side by side): tokens per forward over all of them."""
    f0, t0 = sum(g.forwards for g in engines), sum(g.tokens for g in engines)
    while any(g.live or g.waiting for g in engines):
        for g in engines:
            if g.live or g.waiting:
                g.step()
                if g.prop.shared is not None:  # a real step (milliseconds) outlasts a small segment's I/O;
                    g.prop.shared.flush()  # these stand-ins step in microseconds
    return (sum(g.tokens for g in engines) - t0) / max(1, sum(g.forwards for g in engines) - f0)


def test_engines_sharing_a_history_folder_draft_from_each_others_epochs(tmp_path):
    """verl's and OpenRLHF's layout: one engine per GPU, and each prompt's next epoch on the
    other engine. Through a shared folder each drafts from the epochs the other recorded, as
    much as from the same history pushed; without it a prompt new to an engine has none."""
    base, epoch = task(1)
    halves = [dict(list(base.items())[:12]), dict(list(base.items())[12:])]
    rates = {}
    for name, kw in (("shared", {"history_dir": str(tmp_path / "h"), "history_sync_s": 0}), ("apart", {})):
        runners = [Runner(), Runner()]
        engines = [Engine(proposer(r, **kw), r) for r in runners]
        for e in (1, 2, 3):
            for i, eng in enumerate(engines):
                _add_epoch(eng, halves[(i + e) % 2], epoch, e)  # the halves swap engines every epoch
            rates.setdefault(name, []).append(_run_together(engines))
    runner = Runner()
    pushed = proposer(runner, record=False)
    eng = Engine(pushed, runner)
    pushed.put_history([(k, p, [(2, [epoch(2, int(k[1:]), i) for i in range(4)], [None] * 4)])
                        for k, (p, _) in base.items()])
    _add_epoch(eng, base, epoch, 3)
    rates["pushed"] = eng.run()
    assert rates["shared"][2] >= 0.9 * rates["pushed"], rates
    assert rates["shared"][1] > 1.3 * rates["apart"][1], rates
    segs = list((tmp_path / "h").iterdir())
    assert segs and all(p.name.endswith(".hist.gz") for p in segs)


def test_a_damaged_or_foreign_segment_is_skipped_with_one_warning_and_the_folder_stays_bounded(tmp_path, caplog):
    from rhymerl.drafting import HistoryStore
    from rhymerl.vllm.shared_history import SharedHistory

    folder = tmp_path / "h"
    folder.mkdir()
    (folder / "00000000000000000001-x.hist.gz").write_bytes(b"not gzip at all")
    foreign = HistoryStore()
    foreign.add("p", [1, 2], [[VOCAB + 5]], 1)  # a token this engine's vocabulary lacks
    foreign.save(folder / "00000000000000000002-y.hist.gz")
    good = HistoryStore()
    good.add("q", [1, 2], [[3, 4, 5]], 7)
    good.save(folder / "00000000000000000003-z.hist.gz")
    store = HistoryStore()
    shared = SharedHistory(folder, store, vocab_size=VOCAB, interval_s=0, max_bytes=1)
    with caplog.at_level("WARNING"):
        shared.tick(0.0)
        shared.flush()
        shared.tick(1.0)  # read once: no second warning
        shared.flush()
    assert (shared.read, shared.skipped) == (1, 2) and "p" not in store
    assert store.prompts["q"].rollouts[0].responses == [[3, 4, 5]]
    assert sum("discarded" in r.getMessage() for r in caplog.records) == 2
    shared.record("r", [1], [[6, 7]], 1)
    shared.tick(2.0)  # written, then the folder cut to its bound: the oldest first, its own last
    shared.flush()
    assert [p.name.endswith(shared.engine_id + ".hist.gz") for p in folder.iterdir()] == [True]


def test_one_environment_variable_gives_histospec_to_a_vllm_program_that_cannot_pass_it(model_dir, monkeypatch):
    """TRL's colocate mode and OpenRLHF build their engines with no speculative_config passed
    through: RHYMERL_HISTOSPEC=K (the vllm.general_plugins entry point) gives an engine built
    without one HistoSpec with K tokens, and RHYMERL_HISTOSPEC_CONFIG its additional_config; an
    engine with a speculative_config of its own keeps it; bad values are refused by name."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    from rhymerl.vllm import env_switch

    assert env_switch.from_environment({}) is None
    for bad, name in (({"RHYMERL_HISTOSPEC": "eight"}, "RHYMERL_HISTOSPEC="),
                      ({"RHYMERL_HISTOSPEC": "0"}, "RHYMERL_HISTOSPEC="),
                      ({"RHYMERL_HISTOSPEC": "8", "RHYMERL_HISTOSPEC_CONFIG": "{history"}, "RHYMERL_HISTOSPEC_CONFIG"),
                      ({"RHYMERL_HISTOSPEC": "8", "RHYMERL_HISTOSPEC_CONFIG": "[1]"}, "RHYMERL_HISTOSPEC_CONFIG")):
        with pytest.raises(ValueError, match=name):
            env_switch.from_environment(bad)
    env = {"RHYMERL_HISTOSPEC": "6", "RHYMERL_HISTOSPEC_CONFIG": '{"history_dir": "/shared/h", "record": true}'}
    own = SimpleNamespace(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, additional_config=None,
                          disable_log_stats=True)
    env_switch.apply(own, env)
    assert own.speculative_config["method"] == "ngram" and own.additional_config is None and own.disable_log_stats
    given = SimpleNamespace(speculative_config=None, additional_config={"rhymerl": {"record": False}, "other": 1},
                            disable_log_stats=True)
    env_switch.apply(given, env)
    assert given.additional_config == {"rhymerl": {"history_dir": "/shared/h", "record": False}, "other": 1}
    assert given.disable_log_stats is False  # the acceptance counters need vLLM's statistics

    # Through vLLM itself: the plugin wraps how engine arguments become a config.
    monkeypatch.setattr(EngineArgs, "create_engine_config", EngineArgs.create_engine_config)  # undone after
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    env_switch.register()
    args = EngineArgs(model=model_dir, max_model_len=128, max_num_seqs=8, disable_log_stats=True)  # as LLM() builds it
    cfg = args.create_engine_config()
    assert not args.disable_log_stats
    assert cfg.speculative_config.method == "custom_class"
    assert cfg.speculative_config.num_speculative_tokens == 6
    assert cfg.additional_config["rhymerl"]["history_dir"] == "/shared/h"


def test_verls_engine_kwargs_reach_the_proposer_through_vllms_command_line(model_dir):
    """verl turns ``rollout.engine_kwargs.vllm`` into ``vllm serve`` flags (a dict as JSON): the
    recipe's two keys become HistoSpec with its additional_config, parsed by vLLM's own parser."""
    pytest.importorskip("vllm")
    import json

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    engine_kwargs = {"speculative_config": {"method": "custom_class", "model": "rhymerl.vllm.HistoSpecProposer",
                                            "num_speculative_tokens": 8},
                     "additional_config": {"rhymerl": {"history_dir": "/shared/histospec"}}}
    flags = [x for k, v in engine_kwargs.items() for x in (f"--{k}", json.dumps(v))]  # as verl writes them
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", model_dir, "--max-model-len", "128", *flags])
    cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert (cfg.speculative_config.method, cfg.speculative_config.num_speculative_tokens) == ("custom_class", 8)
    assert cfg.additional_config["rhymerl"] == {"history_dir": "/shared/histospec"}


def test_the_bench_compares_a_method_with_vllms_suffix_round_by_round():
    """A method against ``suffix`` is the median of their ratios within each round (timed one
    after the other), not the ratio of two medians taken over rounds that drifted apart."""
    from rhymerl.bench.common import paired_ratio

    ours, peer = [1.0, 2.0, 1.5], [0.9, 1.9, 1.0]  # medians 1.5 and 1.0; ratios 1.11, 1.05, 1.5
    got = paired_ratio(ours, peer, "vs_suffix", digits=3)
    assert got == {"vs_suffix": 1.111, "vs_suffix_lo": 1.053, "vs_suffix_hi": 1.5}, got
