"""The RL loop: a real run on a tiny config, NaN handling, and kill-and-resume exactness."""
from __future__ import annotations

import json

import pytest
import torch

from rhymerl.config import ConfigError, load_config
from rhymerl.training.checkpoint import latest_checkpoint
from rhymerl.training.metrics.logger import read_metrics

from tests.helpers import TINY, kill_and_resume, learning_metrics, rl_overrides


def test_train_runs_and_writes_run_folder(base_model, tmp_path):
    from rhymerl.training.rl import train

    train(load_config(None, rl_overrides(base_model, tmp_path / "run")), progress=False)
    run = tmp_path / "run"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for key in ("timing_s/gen", "timing_s/update", "perf/throughput", "response_length/mean", "critic/score/mean",
                "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                "spec/accepted_per_forward", "spec/forwards_per_token", "spec/draft_ms"):
        assert key in rows[1], key
    assert (run / "plots.png").exists() and (run / "config.yaml").exists()
    held = json.loads((run / "summary.json").read_text())["heldout"]
    assert set(held) == {"greedy", "sampled"} and held["greedy"]["n"] == 8 and len(held["sampled"]["ci95"]) == 2
    assert list((run / "tensorboard").glob("events.*"))
    assert rows[-1]["data/epoch"] >= 1  # 6 prompts, 4 per step: crossed an epoch boundary
    # the tiny run learns at every step (the exact-resume tests rely on it: weights that never
    # move make any resume look exact)
    assert all(r["actor/grad_norm"] > 1e-3 for r in rows[1:])
    ckpt = latest_checkpoint(run)
    from rhymerl.model import load_pretrained

    base, final = load_pretrained(base_model).state_dict(), load_pretrained(ckpt / "policy").state_dict()
    assert max(float((base[k] - final[k]).abs().max()) for k in base) > 1e-3
    assert ckpt is not None and ckpt.name == "step_000004" and (ckpt / "history.json.gz").exists()
    from rhymerl.training.checkpoint import export_policy
    from transformers import AutoModelForCausalLM

    out = export_policy(run)
    AutoModelForCausalLM.from_pretrained(out)


def test_speculation_does_not_change_learning(base_model, tmp_path):
    from rhymerl.training.rl import train

    train(load_config(None, rl_overrides(base_model, tmp_path / "a") + ["rollout.speculative.method=none"]),
          progress=False)
    train(load_config(None, rl_overrides(base_model, tmp_path / "b") + ["rollout.speculative.gate=false"]),
          progress=False)
    assert learning_metrics(tmp_path / "a") == learning_metrics(tmp_path / "b")
    # the hybrid, with a draft head trained online beside the policy: the same learning
    train(load_config(None, rl_overrides(base_model, tmp_path / "c") + ["rollout.speculative.gate=false",
                                                                      "rollout.speculative.method=hybrid"]),
          progress=False)
    hybrid = learning_metrics(tmp_path / "c")
    assert [{k: v for k, v in r.items() if not k.startswith("draft/")} for r in hybrid] == \
        learning_metrics(tmp_path / "a")
    trained = [r for r in hybrid if "draft/loss" in r]
    assert len(trained) == 4 and trained[-1]["draft/loss"] < trained[0]["draft/loss"]
    spec = [r for r in read_metrics(tmp_path / "c" / "metrics.jsonl") if "spec/accepted_tokens/draft_head" in r]
    assert spec and "draft/accept_rate" in spec[-1]


def test_streamed_update_learns_exactly_what_the_same_split_learns_after_the_rollout(base_model, tmp_path):
    # trainer.stream_update computes the groups' log-probs and the first mini-batch's gradient
    # while the rollout's last samples generate (the worker in its own process); the same prompt
    # split run after the rollout must learn the same bits: streaming changes only when.
    from rhymerl.training.rl import train

    short = ["trainer.steps=2", "trainer.eval_every=0"]
    after = rl_overrides(base_model, tmp_path / "after") + short + ["trainer.minibatch_split=prompts"]
    train(load_config(None, after), progress=False)
    train(load_config(None, rl_overrides(base_model, tmp_path / "streamed") + short + ["trainer.stream_update=true"]),
          progress=False)
    a, b = learning_metrics(tmp_path / "after"), learning_metrics(tmp_path / "streamed")
    assert a == b and any("actor/pg_loss" in r for r in a)
    streamed = [r for r in read_metrics(tmp_path / "streamed" / "metrics.jsonl") if "timing_s/streamed" in r]
    assert streamed and all(r["timing_s/streamed"] > 0 for r in streamed)


@pytest.mark.parametrize("override, named", [
    ("trainer.world_size=2", "trainer.world_size=2"),
    ("trainer.async_staleness=1", "trainer.async_staleness=1"),
    ("algorithm.adv_estimator=reinforce_plus_plus_baseline", "algorithm.adv_estimator"),
    ("trainer.minibatch_split=samples", "trainer.minibatch_split=prompts"),
])
def test_streamed_update_refuses_what_it_cannot_stream(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, ["trainer.stream_update=true", override])


def test_kl_in_reward_replaces_the_kl_loss(base_model, tmp_path):
    from rhymerl.training.rl import train

    # a reward that varies within every group, so the first update moves the policy off the base
    reward = tmp_path / "parity.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    return float(len(solution_str) % 2)\n")
    ov = ["trainer.steps=2", "trainer.eval_every=100", "algorithm.kl_coef=0.5", "trainer.lr=5e-3",
          f"data.reward_file={reward}"]
    train(load_config(None, rl_overrides(base_model, tmp_path / "loss") + ov), progress=False)
    train(load_config(None, rl_overrides(base_model, tmp_path / "reward") + ov + ["algorithm.use_kl_in_reward=true"]),
          progress=False)
    loss = [r for r in read_metrics(tmp_path / "loss" / "metrics.jsonl") if "timing_s/step" in r]
    rew = [r for r in read_metrics(tmp_path / "reward" / "metrics.jsonl") if "timing_s/step" in r]
    assert "actor/kl_loss" in loss[0] and "critic/kl_in_reward" not in loss[0]
    assert "actor/kl_loss" not in rew[0] and "critic/kl_in_reward" in rew[0]
    # step 1 samples the base itself (KL 0); after one update the policy has moved, and the
    # rewards it is trained on are the scores minus the KL
    assert rew[0]["critic/kl_in_reward"] == pytest.approx(0.0, abs=1e-4)
    assert rew[1]["critic/kl_in_reward"] > 0
    assert rew[1]["critic/rewards/mean"] < rew[1]["critic/score/mean"]


def test_dynamic_sampling_filter_drops_groups_without_advantage(base_model, tmp_path):
    from rhymerl.training.rl import train

    # the same reward for every sample of a prompt: no group carries a GRPO advantage
    per_prompt = tmp_path / "per_prompt.py"
    per_prompt.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                          "    return float(int(ground_truth) % 2)\n")
    parity = tmp_path / "parity.py"  # varies within groups
    parity.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    return float(len(solution_str) % 2)\n")
    ov = ["trainer.steps=2", "trainer.eval_every=100", "algorithm.dynamic_sampling=true",
          "algorithm.max_resample_batches=0"]
    train(load_config(None, rl_overrides(base_model, tmp_path / "flat") + ov + [f"data.reward_file={per_prompt}"]),
          progress=False)
    train(load_config(None, rl_overrides(base_model, tmp_path / "mixed") + ov + [f"data.reward_file={parity}"]),
          progress=False)
    flat = [r for r in read_metrics(tmp_path / "flat" / "metrics.jsonl") if "timing_s/step" in r]
    mixed = [r for r in read_metrics(tmp_path / "mixed" / "metrics.jsonl") if "timing_s/step" in r]
    assert all(r["data/filtered_groups"] == 4 and "actor/pg_loss" not in r for r in flat)  # nothing to learn
    for r in mixed:
        kept = 4 - r["data/filtered_groups"]
        assert ("actor/pg_loss" in r) == (kept > 0)
    assert any("actor/pg_loss" in r for r in mixed)


def test_partial_rollouts_carry_groups_and_resume_exactly(base_model, tmp_path):
    """carry_over_tokens pauses long samples and finishes them in the next step, off-policy and
    logged as such; the paused groups travel in the checkpoint, so a resumed run matches."""
    from rhymerl.training.rl import train

    carry = ["rollout.carry_over_tokens=6", "trainer.steps=4"]
    train(load_config(None, rl_overrides(base_model, tmp_path / "ref") + carry), progress=False)
    ref = learning_metrics(tmp_path / "ref")
    steps = [r for r in ref if "rollout/carried_groups" in r]
    assert any(r["rollout/carried_groups"] > 0 for r in steps)
    assert any(r["rollout/offpolicy_tokens"] > 0 for r in steps)
    assert max(r["response_length/max"] for r in steps) > 6  # groups finished after a pause
    part = rl_overrides(base_model, tmp_path / "resumed") + carry
    train(load_config(None, [*part, "trainer.steps=2"]), progress=False)
    state = json.loads((latest_checkpoint(tmp_path / "resumed") / "state.json").read_text())
    assert len(state["carried"]) == steps[1]["rollout/carried_groups"]
    train(load_config(None, part), progress=False)  # continues the run folder from step 2
    assert learning_metrics(tmp_path / "resumed") == ref


def test_half_written_checkpoint_is_never_picked(tmp_path):
    (tmp_path / "checkpoints" / "step_000003").mkdir(parents=True)  # no COMPLETE marker
    (tmp_path / "checkpoints" / "step_000004.tmp").mkdir()
    (tmp_path / "checkpoints" / "step_000002").mkdir()
    (tmp_path / "checkpoints" / "step_000002" / "COMPLETE").write_text("ok")
    assert latest_checkpoint(tmp_path).name == "step_000002"


def test_checkpoint_of_another_model_is_refused(base_model, tmp_path):
    from rhymerl.training.rl import train

    train(load_config(None, rl_overrides(base_model, tmp_path / "run") + ["trainer.steps=1"]), progress=False)
    cfg_path = tmp_path / "run" / "config.yaml"
    ck = latest_checkpoint(tmp_path / "run")
    c = json.loads((ck / "policy" / "config.json").read_text())
    c["num_hidden_layers"] = 1
    (ck / "policy" / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="config.json: SHA-256 differs"):  # the manifest sees it first
        train(resume=str(tmp_path / "run"), progress=False)
    from rhymerl.training.checkpoint import MANIFEST, file_digests

    (ck / MANIFEST).write_text(json.dumps(file_digests(ck)))  # consistent, but of another model
    with pytest.raises(ValueError, match="another model|do not fit"):
        train(resume=str(tmp_path / "run"), progress=False)
    assert cfg_path.exists()


def test_streamed_groups_landing_out_of_order_give_the_same_bits(base_model):
    """The helper computes later groups' log-probs while the next group in order is still out,
    and a second thread joins once the rollout ends; the first mini-batch's gradient must still
    accumulate in the fixed order, so the result is the same bits as processing after the
    rollout, whatever order the groups land in."""
    import random

    from rhymerl.config import load_config as lc
    from rhymerl.model import load_pretrained
    from rhymerl.training.update.stream import StreamedUpdate
    from rhymerl.training.update.trainer import PolicyTrainer

    cfg = lc(None, TINY + ["trainer.minibatch_split=prompts", "trainer.ppo_mini_batches=2"])
    rng = random.Random(0)
    groups = {s: ([3 + s, 4, 5], [[6 + (s + k) % 7] * (1 + (s * k) % 5) for k in range(3)],
                  [float((s + k) % 2) for k in range(3)]) for s in range(8)}
    order, first = [2, 5, 0, 7, 1, 4, 6, 3], {5, 7, 1, 3}

    def run(background: bool, landing: list[int], threads: int = 0):
        model = load_pretrained(base_model)
        tr = PolicyTrainer(model, cfg.trainer, cfg.algorithm, torch.device("cpu"))
        up = StreamedUpdate(tr, cfg, 0, order, first, background=background, threads=threads)
        for s in landing[:-3]:
            up.add(s, *groups[s])
        tail = landing[-3:]  # the last groups land just before the rollout ends
        for s in tail:
            up.add(s, *groups[s])
        up.finish()
        return ({s: (g.exp.old_logp, g.exp.advantages) for s, g in up.groups.items()},
                [p.grad.clone() for p in model.parameters() if p.grad is not None], up.first_tokens)

    ref = run(False, order)
    for landing in (list(reversed(order)), rng.sample(order, len(order)), order):
        got = run(True, landing, threads=1)
        assert got[2] == ref[2]
        assert got[0].keys() == ref[0].keys()
        assert all(torch.equal(got[0][s][0], ref[0][s][0]) and torch.equal(got[0][s][1], ref[0][s][1]) for s in ref[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


def test_nonfinite_update_is_skipped_then_aborts(base_model):
    from rhymerl.config import load_config as lc
    from rhymerl.model import load_pretrained
    from rhymerl.training.update.trainer import Experience, PolicyTrainer

    cfg = lc(None, TINY + ["trainer.max_bad_steps=1"])
    model = load_pretrained(base_model)
    tr = PolicyTrainer(model, cfg.trainer, cfg.algorithm, torch.device("cpu"))
    exp = Experience.build([[3, 4, 5]] * 2, [[6, 7], [8]], [float("nan"), 1.0], pad_id=0)
    tr.compute_logps(exp)
    before = [p.clone() for p in model.parameters()]
    m = tr.update(exp, step=1, seed=0)
    assert m["actor/skipped_updates"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(FloatingPointError, match="max_bad_steps"):
        tr.update(exp, step=2, seed=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logps_are_the_rollout_distribution(temperature):
    """Old log-probs recomputed by the trainer equal the engine's log-probs of the sampled
    tokens under the rollout's sampling distribution (temperature included)."""
    from rhymerl import LLM, SamplingParams
    from rhymerl.training.update.trainer import Experience, PolicyTrainer
    from tests.helpers import tiny_model

    cfg = load_config(None, [f"rollout.temperature={temperature}"])
    model = tiny_model()
    out = LLM(model, max_num_seqs=8, max_model_len=64).generate(
        [[3, 4, 5]], SamplingParams(n=3, temperature=temperature, max_tokens=10, seed=1, logprobs=True,
                                    ignore_eos=True), use_tqdm=False)[0]
    cfg.trainer.ppo_mini_batches = 2  # more than one update per rollout: old log-probs are recomputed
    tr = PolicyTrainer(model, cfg.trainer, cfg.algorithm, torch.device("cpu"), temperature=temperature)
    exp = Experience.build([[3, 4, 5]] * 3, [c.token_ids for c in out.outputs], [0.0] * 3, pad_id=0)
    tr.compute_logps(exp)
    for i, c in enumerate(out.outputs):
        got = exp.old_logp[i][exp.response_mask[i].bool()]
        assert torch.allclose(got, torch.tensor(c.logprobs), atol=1e-5)


def test_token_budget_micro_batches_give_the_same_update():
    """``micro_batch_tokens`` only changes how sequences are grouped (less padding): every
    sequence lands in exactly one micro-batch within the budget, and the update is the same."""
    import copy

    from rhymerl.training.update.trainer import Experience, PolicyTrainer
    from tests.helpers import tiny_model

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 20, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in range(24)]
    responses = [torch.randint(3, 20, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(24)]
    adv = torch.randn(24, generator=g).tolist()
    base = tiny_model()
    weights = []
    for budget in (0, 96):
        cfg = load_config(None, ["trainer.micro_batch_size=8", f"trainer.micro_batch_tokens={budget}"])
        model = copy.deepcopy(base)
        tr = PolicyTrainer(model, cfg.trainer, cfg.algorithm, torch.device("cpu"))
        exp = Experience.build(prompts, responses, adv, pad_id=0)
        exp.advantages = torch.tensor(adv)
        micro = tr._micro_batches(exp, torch.arange(24))
        assert sorted(torch.cat(micro).tolist()) == list(range(24))
        if budget:
            assert len(micro) > 3  # more, smaller micro-batches than 24 / 8
            for m in micro:
                longest = max(len(prompts[i]) + len(responses[i]) for i in m.tolist())
                assert len(m) == 1 or len(m) * (longest + 1) <= budget
                assert len(m) <= 8
        tr.compute_logps(exp)
        tr.update(exp, step=1, seed=0)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(weights[0], weights[1], atol=1e-6)


def test_offpolicy_corrections_anchor_and_weights():
    """tis: clip around the proximal policy, truncated weights; behaviour_clip: clip around the
    behaviour policy, no weights; none: the proximal anchor, no weights."""
    from rhymerl.algos import OFFPOLICY_CORRECTIONS

    prox = torch.tensor([[0.0, -1.0, -0.1]], requires_grad=True)
    behav = torch.tensor([[0.0, -2.0, -0.2]])
    tis = OFFPOLICY_CORRECTIONS["tis"](prox, behav, cap=2.0)
    assert torch.allclose(tis.weights, torch.tensor([[1.0, 2.0, float(torch.exp(torch.tensor(0.1)))]]))
    assert torch.equal(tis.anchor, prox.detach())
    clip = OFFPOLICY_CORRECTIONS["behaviour_clip"](prox, behav, cap=2.0)
    assert torch.equal(clip.anchor, behav) and torch.equal(clip.weights, torch.ones_like(prox))
    none = OFFPOLICY_CORRECTIONS["none"](prox, behav, cap=2.0)
    assert torch.equal(none.anchor, prox.detach()) and torch.equal(none.weights, torch.ones_like(prox))
    for c in (tis, clip, none):
        assert not c.anchor.requires_grad and not c.weights.requires_grad


def test_behaviour_clip_bounds_the_move_from_the_sampling_policy():
    """A token whose probability the live weights already raised past the clip range from the
    policy that drew it gets no further push with behaviour_clip (ratio to the behaviour policy
    is clipped), while the proximal anchor (tis, none) still pushes it (ratio 1 at the start)."""
    from rhymerl.algos import OFFPOLICY_CORRECTIONS, POLICY_LOSSES

    behav = torch.log(torch.tensor([[0.2]]))
    live = torch.log(torch.tensor([[0.4]]))  # the weights moved since the token was drawn
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    loss_fn = POLICY_LOSSES["ppo_clip"]
    grads = {}
    for name in ("behaviour_clip", "tis", "none"):
        logp = live.clone().requires_grad_(True)
        corr = OFFPOLICY_CORRECTIONS[name](live, behav, cap=2.0)
        loss, _ = loss_fn(logp, corr.anchor, adv * corr.weights, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0,
                          agg="token-mean", norm_tokens=1.0, norm_seqs=1.0)
        loss.backward()
        grads[name] = float(logp.grad)
    assert grads["behaviour_clip"] == 0.0 and grads["tis"] < 0.0 and grads["none"] < 0.0


@pytest.mark.slow
def test_async_rl_is_reproducible_and_resumes_exactly_with_a_batch_in_flight(base_model, tmp_path):
    """trainer.async_staleness=1: step t's batch is drawn by version t-2 while step t-1 trains;
    which version is a function of the step, so two runs match, and kill -9 then --resume
    (the checkpoint holds the batch in flight) reproduces the straight run; 2 rollout workers
    give the same run (shape-invariant numerics, as for the synchronous loop)."""
    from rhymerl.training.rl import train

    a = ["trainer.steps=5", "trainer.async_staleness=1", "algorithm.entropy_coef=0.05",
         "rollout.invariant=true", "rollout.threads=1"]
    train(load_config(None, rl_overrides(base_model, tmp_path / "ref") + a), progress=False)
    ref = learning_metrics(tmp_path / "ref")
    steps = [r for r in ref if "async/staleness_mean" in r]
    assert [r["async/staleness_mean"] for r in steps] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(r["async/is_ratio_max"] > 1.0 for r in steps[1:])  # older weights drew those tokens
    state = json.loads((latest_checkpoint(tmp_path / "ref").parent / "step_000004" / "state.json").read_text())
    assert state["inflight"]["step"] == 5 and state["inflight"]["rollout"]["version"] == 3

    run = tmp_path / "killed"
    kill_and_resume(run, rl_overrides(base_model, run) + a + ["rollout.workers=2"], after_step=2)
    assert learning_metrics(run) == ref


def test_the_heldout_gain_carries_a_paired_bootstrap_interval(capsys, tmp_path):
    from rhymerl.training.metrics.summary import paired_gain, print_summary, reward_rise

    before = [0.0] * 60 + [1.0] * 40
    after = [1.0] * 30 + [0.0] * 30 + [1.0] * 40  # +30 points on the same prompts
    g = paired_gain(before, after)
    assert g["n"] == 100 and abs(g["delta"] - 0.30) < 1e-12 and (g["before"], g["after"]) == (0.4, 0.7)
    lo, hi = g["ci95"]
    assert 0.2 < lo < 0.3 < hi < 0.4  # paired: the 40 prompts right in both add no noise
    noise = paired_gain([0.0, 1.0] * 50, [1.0, 0.0] * 50)  # same accuracy, every prompt flipped
    assert noise["delta"] == 0 and noise["ci95"][0] < -0.15 and noise["ci95"][1] > 0.15
    rise = reward_rise([0.125] * 20 + [0.875] * 40 + [0.375] * 20)  # exact in binary
    assert (rise["window"], rise["first"], rise["last"]) == (20, 0.125, 0.375) and rise["rise"] == 0.25
    assert reward_rise([0.0, 1.0, 1.0, 1.0])["window"] == 1  # a short run: a quarter of it
    print_summary({"steps": 1, "wall_s": 1.0, "time_split": {}, "spec_accepted_per_forward": 1.0,
                   "spec_forwards_per_token": 1.0, "heldout": {"greedy": g}, "train_reward": rise}, tmp_path)
    out = capsys.readouterr().out
    assert "held-out greedy accuracy: 40.0% -> 70.0% (+30.0, 95% CI +" in out
    assert "train reward (mean of the first/last 20 steps): 0.12 -> 0.38 (+0.25)" in out


def _collapse(h, steps) -> tuple[list[float], list]:
    """``h``'s health over steps of 1.0 token per forward, and the warnings it logged."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("rhymerl.training.rollout.engine_checks").addHandler(handler)
    try:
        return [h.update(1.0, s) for s in steps], records
    finally:
        logging.getLogger("rhymerl.training.rollout.engine_checks").removeHandler(handler)


def test_drafter_health_marks_a_collapse_once():
    from rhymerl.training.rollout.engine_checks import DrafterHealth

    h = DrafterHealth(window=4)
    healthy = [h.update(v, s) for s, v in enumerate([1.0, 2.4, 2.5, 2.6, 2.5, 2.4], 1)]
    assert all(x > 0.8 for x in healthy[2:])
    collapsed, records = _collapse(h, range(7, 12))
    assert all(x < 0.5 for x in collapsed)  # judged against the healthy trail, not a falling one
    assert len(records) == 1 and "step 9" in records[0].getMessage()


def test_drafter_health_warns_when_the_main_jobs_acceptance_collapses():
    """A trail like the main job's (1.5-1.7 tokens per forward) falling to 1.0: the drafts add
    nothing, so health reads 0 and warns; the collapsed steps never enter the trail (the old
    rule, tokens per forward over its mean, read 0.62 here and never warned)."""
    from rhymerl.training.rollout.engine_checks import DrafterHealth

    h = DrafterHealth(window=10)
    for s, v in enumerate([1.55, 1.62, 1.70, 1.58, 1.66, 1.60], 1):
        assert h.update(v, s) > 0.7
    trail = list(h.trail)
    collapsed, records = _collapse(h, range(7, 12))
    assert all(x < 0.5 for x in collapsed) and len(records) == 1
    assert h.trail == trail


def test_drafter_health_does_not_warn_before_drafting_has_paid():
    """A first epoch that drafts next to nothing (1.00-1.01 tokens per forward) sets no bar: a
    step of 1.00 after it is no collapse (the main job under load warned at step 7 before)."""
    from rhymerl.training.rollout.engine_checks import DrafterHealth

    h = DrafterHealth(window=10)
    for s, v in enumerate([1.0, 1.01, 1.0, 1.005], 1):
        h.update(v, s)
    _, records = _collapse(h, range(5, 10))
    assert records == []
