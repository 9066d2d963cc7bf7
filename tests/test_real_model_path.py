"""The real-model path of examples/qwen2.5-0.5b-gsm8k.yaml, on a tiny Qwen2 of the same layout."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rhymerl.config import load_config
from rhymerl.training.metrics.logger import read_metrics
from tests.helpers import tiny_chat_model

def _gsm8k_rows(n: int, offset: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = (i * 7) % 10, (i * 3) % 10
        rows.append({"prompt": [{"role": "user", "content": f"what is {a}+{b}? end with #### n"}],
                     "data_source": "openai/gsm8k", "reward_model": {"ground_truth": str(a + b)},
                     "extra_info": {"index": offset + i}})
    return rows


@pytest.mark.parametrize("world_size", [1, 2])
def test_example_config_path_on_tiny_qwen2(tmp_path, world_size):
    """The example runs as it is, on one process or on 2 trainer ranks (FSDP; tied embeddings, biases)."""
    tiny_chat_model(tmp_path / "qwen", "abcdefghijklmnopqrstuvwxyz0123456789+?#<>|: \n")
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(_gsm8k_rows(8, 0)), tmp_path / "data" / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_gsm8k_rows(4, 100)), tmp_path / "data" / "test.parquet")
    example = yaml.safe_load(Path("examples/qwen2.5-0.5b-gsm8k.yaml").read_text())
    example["model"].update(path=str(tmp_path / "qwen"), dtype="float32")
    example["data"] = {"train_files": [str(tmp_path / "data" / "train.parquet")],
                       "val_files": [str(tmp_path / "data" / "test.parquet")]}
    example["rollout"].update(n=2, max_tokens=8, max_model_len=96, max_num_seqs=16)
    example["trainer"].update(steps=2, batch_prompts=4, save_every=1, eval_every=2,
                              output_dir=str(tmp_path / "run"), world_size=world_size)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(example))
    from rhymerl.training.rl import train

    train(load_config(tmp_path / "run.yaml"), progress=False)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and "actor/kl_loss" in rows[1]
