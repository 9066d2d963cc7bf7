"""The chat task a pretrained model trains on, and the rhyme measured in every RL step."""
from __future__ import annotations

import random
import string
from pathlib import Path

import pytest
import yaml

from rhymerl.config import ConfigError, load_config
from rhymerl.data.splits import task_splits
from rhymerl.drafting.rhyme import covered_share, covered_tokens
from rhymerl.tasks import ChatSumsTask
from rhymerl.tasks.chat_sums import last_number
from rhymerl.training.metrics.logger import read_metrics
from tests.helpers import tiny_chat_model


def test_chat_sums_asks_in_chat_messages_and_reads_the_last_number():
    task = ChatSumsTask()
    p = task.make_problem(random.Random(3))
    assert isinstance(p.prompt, list) and p.prompt[0]["role"] == "user" and "?" in p.prompt[0]["content"]
    truth = p.ground_truth
    assert task.score(f"Let me add them. The answer is {truth}.", truth) == 1.0
    assert task.score(f"The answer is {truth}. Is there anything else? 1", truth) == 0.0  # talked past it
    assert task.score("I cannot do maths.", truth) == 0.0
    assert last_number("1,234 then -5") == -5 and last_number("total: 1,234") == 1234


def test_a_chat_task_without_a_pretrained_model_is_refused_at_load():
    with pytest.raises(ConfigError, match="chat task for a pretrained model; set model.path"):
        load_config(overrides=["data.task=chat_sums"])
    cfg = load_config(overrides=["data.task=chat_sums", "model.path=/some/folder", "data.num_val=20",
                                 "data.num_train=40"])
    train, val = task_splits(cfg.data, 0)
    assert len(train) == 40 and not {str(r.prompt) for r in train} & {str(r.prompt) for r in val}


def test_covered_tokens_counts_k_grams_that_earlier_responses_hold():
    earlier = [[1, 2, 3, 4, 5, 6]]
    # k=4: grams (1,2,3,4) (2,3,4,5) (3,4,5,6); the response's grams: (1,2,3,4) yes, (2,3,4,9) no, (3,4,9,5) no
    assert covered_tokens([[1, 2, 3, 4, 9, 5]], earlier) == (1, 3)
    assert covered_tokens([[1, 2, 3]], earlier) == (0, 0)  # too short to count
    assert covered_share([[1, 2, 3, 4, 5, 6]], earlier) == 1.0 and covered_share([[7, 7, 7, 7]], earlier) == 0.0


@pytest.fixture
def chat_model(tmp_path) -> Path:
    """A random tiny Qwen2 whose tokenizer has a chat template."""
    return tiny_chat_model(tmp_path / "chat", string.ascii_letters + string.digits + " ?.+<>|\n")


def test_bench_spec_runs_a_chat_models_task_with_top_p(chat_model):
    """`rhymerl bench spec --model M --task chat_sums --top-p 0.9`: the same tokens with HistoSpec."""
    from rhymerl.bench.spec import run

    rep = run(None, model=str(chat_model), task="chat_sums", prompts=2, n=2, max_tokens=8, epochs=(1, 2),
              temperatures=(0.7,), top_p=0.9, gates=(True,), methods=("none", "histospec_path"), reps=1,
              max_num_seqs=4)
    rows = rep["rows"]
    assert {(r["epoch"], r["method"]) for r in rows} == {(e, m) for e in (1, 2) for m in ("none", "histospec_path")}
    assert all(r["identical_tokens"] for r in rows) and rep["task"] == "chat_sums" and rep["top_p"] == 0.9
    assert not any("tail_s" in r for r in rows)  # 4 samples: no tail of two or more


def test_a_rollouts_tail_runs_from_its_ninetieth_percent_sample_to_its_last():
    from rhymerl.bench.spec import tail_seconds

    assert tail_seconds([float(i) for i in range(1, 21)]) == 2.0  # 18 of 20 done at t=18, the last at 20
    assert tail_seconds([1.0] * 29 + [5.0]) == 4.0
    assert tail_seconds([float(i) for i in range(1, 17)]) is None  # 16: 90 % leaves one sample after
    assert tail_seconds([]) is None
    assert tail_seconds([0.5, 1.0, 3.0, 4.0], share=0.5) == 3.0


@pytest.mark.slow
def test_the_smollm2_example_runs_on_a_tiny_chat_model_and_measures_the_rhyme(chat_model, tmp_path):
    """The real-model example as it stands, on a random tiny Qwen2 with a chat template: prompts go
    through the template, and from the second epoch on each step says how much history covers."""
    example = yaml.safe_load(Path("examples/smollm2-chat-sums.yaml").read_text())
    example["model"]["path"] = str(chat_model)
    example["data"].update(num_train=4, num_val=8)
    example["rollout"].update(n=4, max_tokens=12, max_num_seqs=16)
    example["trainer"].update(steps=3, batch_prompts=4, save_every=0, eval_every=0, output_dir=str(tmp_path / "run"))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(example))
    from rhymerl.training.rl import train

    train(load_config(tmp_path / "run.yaml"), progress=False)
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert rows[1]["rhyme/counted_tokens"] == 0  # epoch 1: no history yet
    assert rows[2]["rhyme/counted_tokens"] > 0 and 0.0 <= rows[2]["rhyme/covered_share"] <= 1.0
