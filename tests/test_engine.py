"""Rollout engine: exactness against naive decoding, seeded sampling, limits, tree scoring."""
from __future__ import annotations

import torch

from rhymerl import LLM, SamplingParams
from rhymerl.engine import DraftTree, Proposer
from tests.helpers import naive_greedy, tiny_model, tokens_of

PROMPTS = [[3, 4, 5], [7] * 10, [1, 5], [9, 8, 7, 6, 5], [4, 4], [5, 6, 7, 8, 9, 10, 11], [30] * 17, [12]]


def test_greedy_equals_naive_decode(model):
    llm = LLM(model, max_num_seqs=3, max_model_len=64)  # fewer slots than prompts: continuous batching
    maxes = [5, 20, 9, 13, 3, 30, 11, 25]
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in maxes],
                        use_tqdm=False)
    for p, o, k in zip(PROMPTS, outs, maxes):
        assert o.outputs[0].token_ids == naive_greedy(model, p, k)
        assert o.outputs[0].finish_reason == "length"



def test_sampled_output_independent_of_batch(model):
    sp = SamplingParams(n=2, temperature=0.9, top_p=0.95, max_tokens=24, seed=7, ignore_eos=True)
    alone = tokens_of(LLM(model, max_num_seqs=8, max_model_len=64).generate([PROMPTS[1]], sp, use_tqdm=False))[0]
    llm = LLM(model, max_num_seqs=64, max_model_len=64)
    in_batch = tokens_of(llm.generate(PROMPTS, sp, use_tqdm=False))[1]
    reordered = tokens_of(llm.generate(PROMPTS[::-1] * 8, sp, use_tqdm=False))[len(PROMPTS) - 2]
    small = tokens_of(LLM(model, max_num_seqs=2, max_model_len=64).generate(PROMPTS, sp, use_tqdm=False))[1]
    assert alone == in_batch == reordered == small


def _removed_by_value(scaled: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """top-k then top-p of one row by value, the slow way: a full sort in float64."""
    x = scaled.double()
    V = x.numel()
    kept = x >= (x.sort(descending=True).values[top_k - 1] if 0 < top_k < V else -float("inf"))
    probs = x.masked_fill(~kept, -float("inf")).softmax(-1)
    if top_p < 1:
        better = torch.stack([probs[x > v].sum() for v in x])  # mass strictly more likely
        kept &= better < top_p
    kept[x.argmax()] = True
    return ~kept


def test_top_p_and_top_k_remove_by_value_ties_alike_and_rows_independent_of_their_batch():
    from rhymerl.engine.sampler import CANDIDATES, removed_tokens

    g = torch.Generator().manual_seed(0)
    V = 4 * CANDIDATES
    peaked = torch.randn(3, V, generator=g)
    peaked[:, :4] += 9  # the cut among the first candidates
    flat = torch.randn(3, V, generator=g) * 0.3  # the cut far beyond them: sorted in full
    tied = torch.randn(3, V, generator=g).mul(2).round()  # ties
    tied[1] = -20.0
    tied[1, :5] = torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0])  # a tie straddling p = 0.5: kept whole
    rows = torch.cat([peaked, flat, tied])
    top_p = torch.tensor([0.9, 0.5, 1.0] * 3)
    top_k = torch.tensor([-1, -1, 5, -1, 40, -1, 3, -1, 7])
    got = removed_tokens(rows, top_p, top_k)
    for i in range(len(rows)):
        want = _removed_by_value(rows[i], float(top_p[i]), int(top_k[i]))
        assert torch.equal(got[i], want), i
        alone = removed_tokens(rows[i:i + 1], top_p[i:i + 1], top_k[i:i + 1])
        assert torch.equal(torch.zeros(V, dtype=torch.bool) if alone is None else alone[0], got[i]), i
    assert removed_tokens(rows, torch.ones(9), torch.full((9,), -1)) is None


def test_seeds_and_samples_differ(model):
    llm = LLM(model, max_num_seqs=16, max_model_len=64)
    a = llm.generate([PROMPTS[0]], SamplingParams(n=4, max_tokens=20, seed=1, ignore_eos=True), use_tqdm=False)[0]
    b = llm.generate([PROMPTS[0]], SamplingParams(n=4, max_tokens=20, seed=1, ignore_eos=True), use_tqdm=False)[0]
    c = llm.generate([PROMPTS[0]], SamplingParams(n=4, max_tokens=20, seed=2, ignore_eos=True), use_tqdm=False)[0]
    ta, tb, tc = ([x.token_ids for x in r.outputs] for r in (a, b, c))
    assert ta == tb
    assert ta != tc
    assert len({tuple(t) for t in ta}) == 4


def test_stop_tokens_and_limits(model):
    llm = LLM(model, max_num_seqs=4, max_model_len=16)
    free = naive_greedy(model, PROMPTS[0], 12)
    stop = free[4]
    first = free.index(stop)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    # max_model_len caps prompt + response
    out = llm.generate([[1] * 10], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_a_request_ended_by_its_first_token_is_returned_by_that_step(model):
    """A sample that stops at prefill (its first token is a stop token, or max_tokens=1) is
    returned by the step that ended it: the rollout workers report finished work from the steps'
    returns, so a request missing there waits forever (a rollout hung this way)."""
    llm = LLM(model, max_num_seqs=4, max_model_len=16)
    first = naive_greedy(model, PROMPTS[0], 1)[0]
    eng = llm.engine
    for sp in (SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0, max_tokens=8,
                                                                           stop_token_ids=[first])):
        rid = eng.add_request(list(PROMPTS[0]), sp, 0, None)
        done = eng.step()
        assert [o.request_id for o in done] == [rid] and not eng.has_unfinished()
        assert eng.pop_request(rid).outputs[0].token_ids == [first]


def test_each_sample_carries_when_it_finished_and_outputs_compare_without_it(model):
    """``finished_at`` (the engine's clock when a sample ended) orders samples by when their last
    token came, which is what a rollout's tail is measured from; two runs' outputs still compare
    equal, the time not being part of a sample."""
    import time

    llm = LLM(model, max_num_seqs=4, max_model_len=64)
    maxes = [3, 20, 9, 14]
    t0 = time.perf_counter()
    outs = llm.generate([PROMPTS[0]] * 4, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in maxes],
                        use_tqdm=False)
    t1 = time.perf_counter()
    at = [o.outputs[0].finished_at for o in outs]
    assert all(t0 < t <= t1 for t in at)
    assert len(set(at)) == 4 and [maxes[i] for i in sorted(range(4), key=at.__getitem__)] == sorted(maxes)
    again = llm.generate([PROMPTS[0]] * 4, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in maxes],
                         use_tqdm=False)
    assert [o.outputs for o in again] == [o.outputs for o in outs]


def test_overlong_prompt_fails_alone(model):
    llm = LLM(model, max_num_seqs=4, max_model_len=16)
    outs = llm.generate([[1] * 20, PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert outs[0].error is not None and "max_model_len=16" in outs[0].error and not outs[0].outputs
    assert outs[1].error is None and outs[1].outputs[0].token_ids == naive_greedy(model, PROMPTS[0], 4)


def test_small_kv_budget_makes_requests_wait(model):
    # Room for exactly 2 sequences: 12 samples must queue, and all still complete exactly.
    llm = LLM(model, max_num_seqs=64, max_model_len=40, kv_cache_tokens=2 * 41)
    assert llm.engine.cache.num_slots == 2
    outs = llm.generate(PROMPTS[:6], SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert all(c.token_ids == naive_greedy(model, p, 10) for c in o.outputs)


def test_logprobs_equal_log_softmax(model):
    llm = LLM(model, max_num_seqs=4, max_model_len=64)
    for temp in (1.0, 0.7):
        out = llm.generate([PROMPTS[3]], SamplingParams(temperature=temp, max_tokens=10, seed=3, logprobs=True,
                                                        ignore_eos=True), use_tqdm=False)[0].outputs[0]
        ids = torch.tensor([PROMPTS[3] + out.token_ids])
        with torch.no_grad():
            logp = (model(ids)[0, len(PROMPTS[3]) - 1: -1] / temp).log_softmax(-1)
        ref = logp.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5)


def test_update_weights_in_place(model):
    llm = LLM(model, max_num_seqs=4, max_model_len=64)
    other = tiny_model(seed=5)
    cache = llm.engine.cache.k
    llm.update_weights(dict(other.named_parameters()))
    assert llm.engine.cache.k is cache
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == naive_greedy(other, PROMPTS[0], 8)


class FixedTrees(Proposer):
    """A proposer that returns given trees (by sequence), to test the scoring mechanism alone."""

    def __init__(self, make, max_nodes: int = 12) -> None:
        self.make, self.max_nodes = make, max_nodes
        self.accepted: list[int] = []

    def propose(self, seqs):
        return [self.make(s) for s in seqs]

    def observe(self, seqs, drafted, accepted):
        self.accepted += accepted

    def on_finish(self, seq):
        pass


def test_tree_scoring_keeps_greedy_output_and_accepts_true_branch(model):
    refs = {i: naive_greedy(model, p, 30) for i, p in enumerate(PROMPTS)}

    def make(seq):
        # A tree whose one branch is the true continuation (3 deep) among wrong siblings.
        g = len(seq.output_ids)
        truth = refs[seq.request_id][g: g + 3]
        if len(truth) < 3:
            return None
        wrong = [(t + 1) % 40 for t in truth]
        # nodes: 0 wrong0, 1 true0, 2 wrong1 (under true0), 3 true1 (under true0), 4 true2 (under true1)
        return DraftTree((wrong[0], truth[0], wrong[1], truth[1], truth[2]), (-1, -1, 1, 1, 3))

    prop = FixedTrees(make)
    llm = LLM(model, max_num_seqs=8, max_model_len=64, speculative=prop)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == refs[i]
    assert prop.accepted and max(prop.accepted) == 3
    assert llm.engine.stats.forwards < 30 * len(PROMPTS) / 3


def test_tree_scoring_logits_equal_single_path():
    """Each node's logits in one tree pass equal those of running its path alone."""
    from rhymerl.engine.kv_cache import KVCache
    from rhymerl.engine.model_runner import ModelRunner
    from rhymerl.engine.sequence import Sequence

    m = tiny_model()
    prompt = [5, 6, 7, 8]
    tree = DraftTree((10, 11, 12, 13), (-1, -1, 0, 2))  # two branches: 10->12->13 and 11
    cache = KVCache(m.config, 1, 32, torch.device("cpu"), torch.float32)
    runner = ModelRunner(m, cache, torch.device("cpu"))
    seq = Sequence(0, 0, prompt, SamplingParams(temperature=0, max_tokens=10), seed=0)
    seq.slot = 0
    runner.prefill([[seq]])
    captured = {}
    orig = m.forward

    def spy(*a, **k):
        out = orig(*a, **k)
        captured["logits"] = out
        return out

    m.forward = spy  # type: ignore[method-assign]
    runner.decode([seq], [tree])
    m.forward = orig  # type: ignore[method-assign]
    logits = captured["logits"][0]
    first = seq.output_ids[0]
    paths = {0: [first], 1: [first, 10], 2: [first, 11], 3: [first, 10, 12], 4: [first, 10, 12, 13]}
    with torch.no_grad():
        for node, path in paths.items():
            ref = m(torch.tensor([prompt + path]))[0, -1]
            assert (logits[node] - ref).abs().max().item() < 1e-4


def test_siblings_admitted_later_reuse_the_prompt(model):
    """With fewer slots than samples, later siblings copy the prompt's K/V from a running
    sibling instead of prefilling it again; the tokens do not change."""
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]]
    sp = SamplingParams(n=6, temperature=1.5, max_tokens=12, seed=5)  # samples end at different lengths
    wide = LLM(model, max_num_seqs=16, max_model_len=64)
    narrow = LLM(model, max_num_seqs=4, max_model_len=64)
    ref = [[c.token_ids for c in o.outputs] for o in wide.generate(prompts, sp, use_tqdm=False)]
    got = narrow.generate(prompts, sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == ref
    assert len({len(t) for o in ref for t in o}) > 1
    assert narrow.engine.runner.reused_prompts > 0
    assert len(narrow.engine.runner.prompt_logits) <= len(prompts)


def _naive_walk(sampled: list[int], tokens: list[int], parents: list[int]) -> list[int]:
    """The acceptance rule read literally: from the root, step to the child carrying the drawn token."""
    path, cur = [0], 0
    while True:
        nxt = [c for c in range(1, len(tokens)) if parents[c] == cur and tokens[c] == sampled[cur]]
        if not nxt:
            return path
        cur = nxt[0]
        path.append(cur)


def test_walk_tree_matches_the_literal_walk_on_random_trees():
    from rhymerl.engine.acceptance import ancestors, walk_tree

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        chain = trial % 2 == 0
        B, V = 5, 3  # a tiny vocabulary so that many drafts are accepted
        rows = []
        for _ in range(B):
            n = int(torch.randint(0, 12, (1,), generator=g))
            toks: list[int] = []
            pars: list[int] = []
            for i in range(n):
                if chain:
                    p = i - 1
                else:
                    p = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
                free = [t for t in range(V) if (p, t) not in set(zip(pars, toks))]
                if not free:
                    break
                pars.append(p)
                toks.append(free[int(torch.randint(0, len(free), (1,), generator=g))])
            rows.append(DraftTree(tuple(toks), tuple(pars)))
        T = 1 + max(len(d) for d in rows)
        tok = torch.full((B, T), -1)
        par = torch.full((B, T), -1)
        dep = torch.zeros(B, T, dtype=torch.long)
        for b, d in enumerate(rows):
            tok[b, 0] = 0
            for i, (t, p, dd) in enumerate(zip(d.tokens, d.parents, d.depths)):
                tok[b, i + 1], par[b, i + 1], dep[b, i + 1] = t, p + 1, dd
        sampled = torch.randint(0, V, (B, T), generator=g)
        max_depth = int(dep.max())
        assert all(d.is_path for d in rows) or not chain
        # the general walk on every tree; for path drafts also the chain shortcut
        ways = [walk_tree(sampled, tok, par, dep, ancestors(par, max_depth), max_depth)]
        if chain:
            ways.append(walk_tree(sampled, tok, par, dep, ancestors(par, max_depth, chain=True), max_depth, chain=True))
        for path, n_acc in ways:
            for b in range(B):
                want = _naive_walk(sampled[b].tolist(), tok[b].tolist(), par[b].tolist())
                n = len(want) - 1
                assert int(n_acc[b]) == n
                assert path[b, : n + 1].tolist() == want
                assert (path[b, n + 1:] == want[-1]).all()


def test_per_sequence_draw_key_gives_the_same_uniforms():
    """The sampler hashes (seed, sample) once per sequence in Python integers; the draws must be
    the very bits of the all-tensor hash, for seeds and positions across the int64 range."""
    from rhymerl.engine.sampler import draw_key, uniforms, uniforms_at

    g = torch.Generator().manual_seed(0)
    seeds = [0, 1, (1 << 62) - 1, *torch.randint(0, 1 << 62, (200,), generator=g).tolist()]
    samples = torch.randint(0, 64, (len(seeds),), generator=g).tolist()
    pos = torch.randint(0, 1 << 20, (len(seeds),), generator=g)
    keys = torch.tensor([draw_key(s, k) for s, k in zip(seeds, samples)], dtype=torch.long)
    assert torch.equal(uniforms_at(keys, pos), uniforms(torch.tensor(seeds), torch.tensor(samples), pos))
