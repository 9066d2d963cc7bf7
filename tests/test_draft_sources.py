"""Model draft sources (a draft model, a draft head), the hybrid, and the source registry."""
from __future__ import annotations

import pytest
import torch

from rhymerl.engine import SamplingParams
from rhymerl.llm import LLM
from rhymerl.model import save_pretrained

from tests.helpers import tiny_model, tokens_of

PROMPTS = [[3, 4, 5, 6 + i] for i in range(8)]
KEYS = [f"p{i}" for i in range(8)]



def _run(model, spec, sp, keys=None):
    llm = LLM(model, max_num_seqs=64, max_model_len=96, speculative=spec)
    outs = llm.generate(PROMPTS, sp, prompt_keys=keys, use_tqdm=False)
    return tokens_of(outs), llm


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    save_pretrained(tiny_model(std=0.25), out)
    return str(out)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_model_is_lossless_and_coupled_drafting_beats_greedy_drafts(target_dir, temperature):
    """The target as its own draft model: coupled drafts (the target's uniforms) are accepted
    whole; greedy drafts at T=1 far less often. Tokens are plain decoding's either way."""
    m = tiny_model(std=0.25)
    sp = SamplingParams(n=4, temperature=temperature, max_tokens=40, ignore_eos=True, seed=7)
    ref, _ = _run(m, None, sp)
    per_forward = {}
    for coupled in (True, False):
        for tree in (0, 8):
            spec = {"method": "draft_model", "draft_model": target_dir, "gate": False, "coupled": coupled,
                    "tree_budget": tree}
            got, llm = _run(m, spec, sp)
            assert got == ref, (coupled, tree)
            per_forward[coupled, tree] = llm.engine.stats.accepted_per_forward
    assert per_forward[True, 0] > 3.5  # 4 drafted per forward, all accepted once lengths have grown
    if temperature > 0:
        assert per_forward[False, 0] < per_forward[True, 0] - 1.0
        assert per_forward[False, 8] > per_forward[False, 0]  # the second-best leaves catch some misses


def test_draft_model_with_another_vocabulary_is_refused(tmp_path):
    save_pretrained(tiny_model(vocab_size=48), tmp_path / "d")
    with pytest.raises(ValueError, match="draft_model=.*vocabulary of 48"):
        LLM(tiny_model(), speculative={"method": "draft_model", "draft_model": str(tmp_path / "d")})
    with pytest.raises(ValueError, match="draft_model=.*not a folder"):
        LLM(tiny_model(), speculative={"method": "draft_model", "draft_model": str(tmp_path / "none")})


def test_unknown_source_and_method_name_the_valid_ones():
    from rhymerl.drafting import build_proposer

    with pytest.raises(ValueError, match="'nope' is not one of .*'prompt_history'"):
        build_proposer({"sources": ["nope"]})
    with pytest.raises(ValueError, match="method 'nope' is not one of .*'hybrid'"):
        build_proposer({"method": "nope"})
    with pytest.raises(ValueError, match="unknown keys \\['siblingz'\\]"):
        build_proposer({"siblingz": False})


def test_a_new_source_is_one_class_and_one_registry_line():
    """A source registered by name drafts under the controller, and tokens stay exact."""
    from rhymerl.drafting import Candidate, DraftSource, SOURCES, register_source
    from rhymerl.drafting.suffix_index import Matches

    @register_source("always_seven")
    class Sevens(DraftSource):
        def __init__(self, ctx):
            pass

        def candidate(self, seq, cap):
            return Candidate(self.name, 3, Matches.of_tokens([[7] * 8]))

    try:
        m = tiny_model(std=0.25)
        sp = SamplingParams(n=2, temperature=1.0, max_tokens=20, ignore_eos=True, seed=3)
        ref, _ = _run(m, None, sp)
        got, llm = _run(m, {"sources": ["always_seven"], "gate": False}, sp)
        assert got == ref and llm.engine.stats.drafted > 0
        assert llm.proposer.drafted_by_source["always_seven"] > 0
    finally:
        del SOURCES["always_seven"]


def _trained_head(model, steps: int):
    """A draft head trained as the RL update trains it, on sequences the model sampled."""
    from rhymerl.training.update.draft_head_trainer import DraftHeadTrainer

    sp = SamplingParams(n=8, temperature=1.0, max_tokens=40, ignore_eos=True, seed=11)
    outs = LLM(model, max_num_seqs=64, max_model_len=96).generate(PROMPTS, sp, use_tqdm=False)
    ids = torch.tensor([o.prompt_token_ids + c.token_ids for o in outs for c in o.outputs])
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    mask[:, len(PROMPTS[0]) - 1:] = 1
    tr = DraftHeadTrainer(model, lr=3e-3, device=torch.device("cpu"))
    losses = []
    for _ in range(steps):
        with tr.watching():
            model(ids)
        loss, _, ntok = tr.train_on(ids, mask)
        losses.append(loss / ntok)
    return tr, losses


def test_draft_head_trains_on_the_policy_forward_and_drafts_losslessly(tmp_path):
    from rhymerl.drafting.draft_head import PREFIX

    m = tiny_model(std=0.25)
    tr, losses = _trained_head(m, 150)
    assert losses[-1] < 0.3 * losses[0]
    assert all(p.grad is None for p in m.parameters())  # the policy is read, never trained
    # The sequences it was trained on (a random tiny model's dynamics do not generalise from
    # 64 samples; the main job measures generalisation): drafts must follow what it learnt.
    sp = SamplingParams(n=8, temperature=1.0, max_tokens=40, ignore_eos=True, seed=11)
    ref, _ = _run(m, None, sp)
    fresh, llm0 = _run(m, {"method": "draft_head", "gate": False}, sp)
    # the trained weights pushed the way a weight sync pushes them (names draft_head.*)
    llm = LLM(m, max_num_seqs=64, max_model_len=96, speculative={"method": "draft_head", "gate": False})
    llm.update_weights({**dict(m.named_parameters()), **tr.named()})
    trained = tokens_of(llm.generate(PROMPTS, sp, use_tqdm=False))
    assert fresh == ref and trained == ref
    assert llm.engine.stats.accepted_per_forward > llm0.engine.stats.accepted_per_forward + 1.0
    # saved and loaded as LLM(speculative={"method": "draft_head", "draft_head": PATH}) does
    tr.save(tmp_path)
    loaded, llm2 = _run(m, {"method": "draft_head", "gate": False, "draft_head": str(tmp_path / "draft_head")}, sp)
    assert loaded == ref and llm2.engine.stats.accepted_per_forward == llm.engine.stats.accepted_per_forward
    assert all(k.startswith(PREFIX) for k in tr.named())


def test_hybrid_picks_a_source_per_request_and_keeps_tokens(target_dir):
    """History for half the prompts: the hybrid drafts those from history where it matches and
    the rest from the model, and says which source earned each accepted token."""
    from rhymerl.drafting import HistoryStore, build_proposer

    m = tiny_model(std=0.25)
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=40, ignore_eos=True, seed=7)
    ref, _ = _run(m, None, sp)
    store = HistoryStore()
    for k, p, toks in list(zip(KEYS, PROMPTS, ref))[:4]:
        store.add(k, p, toks, step=0)  # these prompts' history is the very responses to come
    prop = build_proposer({"method": "hybrid", "draft_model": target_dir, "gate": False, "model_draft_tokens": 2},
                          store, target=m)
    got, llm = _run(m, prop, sp, keys=KEYS)
    assert got == ref
    acc = prop.accepted_by_source
    assert acc["draft_model"] > 0 and acc["prompt_history"] + acc["siblings"] > 0, dict(acc)


def test_union_tree_shares_prefixes_and_keeps_the_best_nodes():
    from rhymerl.drafting.controller import union_tree
    from rhymerl.engine.draft import DraftTree

    a = DraftTree.path([5, 6, 7])
    b = DraftTree((5, 9, 8), (-1, 0, -1))  # 5 -> 9, and 8 beside 5
    tree, probs = union_tree([(a, [0.9, 0.8, 0.3]), (b, [0.95, 0.5, 0.2])], budget=4)
    nodes = {(tree.parents[i], t) for i, t in enumerate(tree.tokens)}
    assert tree.tokens[0] == 5 and probs[0] == 0.95  # shared once, at its best probability
    assert len(tree) == 4 and (0, 6) in nodes and (0, 9) in nodes and (1, 7) in nodes and (-1, 8) not in nodes
    assert probs == sorted(probs, reverse=True)


def _eagle3_chain(head, aux, embeds, cos, sin, p: int, steps: int) -> list[torch.Tensor]:
    """vLLM's Eagle3 drafting, one position at a time: step 1 over positions 0..p fills the draft's
    cache from the target's states; each later step drafts at the next position from the previous
    step's residual stream, reading that cache and the keys it added itself."""
    layer = head.midlayer

    def run(hidden, t, keys, values):
        x = torch.cat([layer.input_layernorm(embeds[:, t:t + 1]), layer.hidden_norm(hidden)], -1)
        q, k, v = layer.self_attn.qkv(x, cos[:, :, t:t + 1], sin[:, :, t:t + 1])
        keys, values = keys + [k], values + [v]
        w = torch.softmax(torch.cat([q @ kk.transpose(-1, -2) for kk in keys], -1) * q.shape[-1] ** -0.5, -1)
        attn = w @ torch.cat(values, 2)
        hidden = hidden + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(1, 1, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, head.lm_head(head.norm(hidden)), keys, values

    keys, values = [], []
    for t in range(p + 1):  # the cache of the verified prefix
        hidden, logits, keys, values = run(head.fc(aux[:, t:t + 1]), t, keys, values)
    out = [logits]
    for s in range(1, steps):
        hidden, logits, keys, values = run(hidden, p + s, keys, values)
        out.append(logits)
    return out


def test_an_eagle3_head_trains_each_draft_step_as_vllm_drafts_it():
    """The head's batched forward over every position gives, at step s and position t, the logits
    vLLM's drafter computes at its s-th draft when the chain starts at t - s + 1 (from its own
    residual stream and its draft cache); training on the steps teaches the later ones too."""
    from rhymerl.vllm.eagle3_head import new_head
    from rhymerl.training.update.eagle3_trainer import Eagle3Trainer

    policy = tiny_model(num_hidden_layers=4)
    head = new_head(policy.config, seed=1).eval()
    for prm in head.parameters():  # a fresh head's 0.02 weights would hide a wrong mask
        torch.nn.init.normal_(prm, std=0.3)
    T, H = 12, policy.config.hidden_size
    g = torch.Generator().manual_seed(0)
    aux, embeds = torch.randn(1, T, 3 * H, generator=g), torch.randn(1, T, H, generator=g)
    cos, sin = policy.model.rotary_emb(torch.arange(T)[None], torch.float32)
    with torch.no_grad():
        batched = head(aux, embeds, cos, sin, steps=3)
        for p in (0, 4, 9):
            chain = _eagle3_chain(head, aux, embeds, cos, sin, p, steps=3)
            for s, logits in enumerate(chain):
                torch.testing.assert_close(batched[s][:, p + s], logits[:, 0], rtol=1e-4, atol=1e-4)

    # Trained on one repeated sequence, every step learns it; trained on step 1 only, later ones don't.
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 2])
    mask = torch.ones(1, ids.shape[1] - 1, dtype=torch.bool)
    for steps in (1, 3):
        trainer = Eagle3Trainer(policy, "unused", lr=1e-2, device=torch.device("cpu"), seed=0, steps=steps)
        for _ in range(60):
            with trainer.watching(), torch.no_grad():
                policy(ids)
            trainer.train_on(ids, mask)
        with trainer.watching(), torch.no_grad():
            policy(ids)
            trainer.steps = 3
            out = trainer.draft_logits(ids)
        third = float((out[2][:, 2:].argmax(-1) == ids[:, 4:]).float().mean())
        assert (third > 0.9) if steps == 3 else (third < 0.5), (steps, third)
