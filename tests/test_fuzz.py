"""Fuzzed input: data rows, config values, history files, checkpoint folders.

Every case must end in a clear error of the documented type (naming the file, row or key)
or a discarded file, never another exception from deep inside, and what loads must be what a
run can use (token ids within the vocabulary; a checkpoint restores the same state or is
refused). The number of cases per test is ``RHYMERL_FUZZ_EXAMPLES`` (1,000 in the default run).
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rhymerl.config import ConfigError, RunConfig, load_config
from rhymerl.data.dataset import DatasetError, PromptRow, load_dataset_files, parse_row

EXAMPLES = int(os.environ.get("RHYMERL_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
VALID_ROW = {"prompt": "1+2=", "data_source": "arith", "reward_model": {"ground_truth": "3"},
             "extra_info": {"index": 7}}


@st.composite
def rows(draw) -> object:
    """A valid row with some fields replaced, dropped or added, or anything JSON at all."""
    if draw(st.booleans()):
        return draw(json_values)
    row = json.loads(json.dumps(VALID_ROW))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from([("prompt",), ("data_source",), ("reward_model",), ("reward_model", "ground_truth"),
                                     ("extra_info",), ("extra_info", "index"), ("other",)]))
        target = row
        for p in path[:-1]:
            target = target.setdefault(p, {}) if isinstance(target, dict) else {}
        if not isinstance(target, dict):
            continue
        if draw(st.booleans()):
            target.pop(path[-1], None)
        else:
            target[path[-1]] = draw(json_values)
    return row


@FUZZ
@given(rows())
def test_fuzzed_rows_parse_or_name_the_row(raw):
    try:
        r = parse_row(raw, source="train.jsonl", row=3)
    except DatasetError as e:
        assert str(e).startswith("train.jsonl: row 3:")
    else:
        assert isinstance(r, PromptRow) and r.prompt and isinstance(r.key, str)


@FUZZ
@given(st.lists(st.text(max_size=60) | rows().map(json.dumps), min_size=0, max_size=6))
def test_fuzzed_jsonl_files_load_or_name_the_file(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("rows") / "train.jsonl"
    path.write_text("\n".join(lines))
    try:
        got = load_dataset_files([str(path)])
    except DatasetError as e:
        assert str(path) in str(e) or "no rows" in str(e)
    else:
        assert got and all(isinstance(r, PromptRow) for r in got)


def _keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


KEYS = _keys(RunConfig().to_dict())
yaml_texts = st.sampled_from(["", "0", "-1", "1e-5", "2.5", "true", "null", "[1, 2]", "{a: 1}", "abc", "'3'", "nan",
                              "inf", "-0.0", "1e400", "[", "x: [", "999999999999999999999", "ray", "cuda:7",
                              "bfloat16", "histopipe"]) | st.text(max_size=15)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(KEYS) | st.text(max_size=12).filter(lambda k: "=" not in k), yaml_texts),
                max_size=4))
def test_fuzzed_config_overrides_validate_or_name_the_key(pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        cfg = load_config(None, overrides)
    except ConfigError as e:  # names the key path, or the override when it has no key
        assert any(k.strip() and k.strip().split(".")[0] in str(e) or repr(f"{k}={v}") in str(e)
                   for k, v in pairs), str(e)
    else:
        assert isinstance(cfg, RunConfig)


@FUZZ
@given(st.text(max_size=200) | st.dictionaries(st.sampled_from(list(RunConfig().to_dict()) + ["zz"]), json_values,
                                                 max_size=4).map(json.dumps))
def test_fuzzed_config_files_validate_or_name_the_file(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "run.yaml"
    path.write_text(text)
    try:
        cfg = load_config(path)
    except ConfigError as e:
        assert str(e)
    else:
        assert isinstance(cfg, RunConfig)


@pytest.fixture(scope="module")
def history_file(tmp_path_factory) -> bytes:
    from rhymerl.drafting import HistoryStore

    store = HistoryStore(max_rollouts=2)
    for step in range(3):
        for k in range(4):
            store.add(f"p{k}", [1, 2, 3], [[4 + step, 5, 6 + k], [7, 8]], step, [1.0, 0.0])
    path = tmp_path_factory.mktemp("hist") / "h.json.gz"
    store.save(path)
    return path.read_bytes()


@FUZZ
@given(data=st.data())
def test_fuzzed_history_files_load_or_are_discarded(tmp_path_factory, history_file, data, caplog):
    from rhymerl.drafting import HistoryStore

    raw = gzip.decompress(history_file)
    how = data.draw(st.sampled_from(["bytes", "gzip-bytes", "body", "flip"]))
    if how == "bytes":
        blob = data.draw(st.binary(max_size=300))
    elif how == "gzip-bytes":
        blob = gzip.compress(data.draw(st.binary(max_size=300)))
    elif how == "flip":
        pos = data.draw(st.integers(0, len(history_file) - 1))
        blob = history_file[:pos] + bytes([history_file[pos] ^ data.draw(st.integers(1, 255))]) + history_file[pos + 1:]
    else:  # a valid checksum over a fuzzed body: the guard must still hold
        import hashlib

        body = json.loads(json.loads(raw)["body"])
        key = data.draw(st.sampled_from(["max_rollouts", "prompt_tail", "prompts", "tokenizer", "version"]))
        body[key] = data.draw(json_values)
        text = json.dumps(body)
        blob = gzip.compress(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": text}).encode())
    path = tmp_path_factory.mktemp("h") / "h.json.gz"
    path.write_bytes(blob)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        store = HistoryStore.load(path, vocab_size=HISTORY_VOCAB)
    assert isinstance(store, HistoryStore)
    if str(path) in caplog.text:  # discarded (said so, naming the file): nothing of it kept
        assert not store.prompts
    # what loads is usable: every id within the vocabulary (one beyond it crashed generation on
    # every resume), every prompt within the store's rollout limit
    for h in store.prompts.values():
        assert len(h.rollouts) <= store.max_rollouts
        assert all(isinstance(t, int) and 0 <= t < HISTORY_VOCAB for t in h.prompt_tail)
        assert all(isinstance(t, int) and 0 <= t < HISTORY_VOCAB
                   for r in h.rollouts for resp in r.responses for t in resp)


HISTORY_VOCAB = 64


def test_a_history_with_token_ids_beyond_the_vocabulary_or_a_huge_body_is_discarded(tmp_path, caplog):
    import hashlib

    from rhymerl.drafting import HistoryStore

    store = HistoryStore(max_rollouts=1)
    store.add("p", [1, 2], [[3, 4, 10**9]], 1, [1.0])  # a checksum-valid store with an id far past any vocab
    store.save(tmp_path / "h.json.gz")
    with caplog.at_level(logging.WARNING):
        assert HistoryStore.load(tmp_path / "h.json.gz", vocab_size=HISTORY_VOCAB).prompts == {}
    assert "beyond the vocabulary" in caplog.text
    body = json.dumps({"pad": "x" * 5000})
    (tmp_path / "big.json.gz").write_bytes(gzip.compress(json.dumps(
        {"sha256": hashlib.sha256(body.encode()).hexdigest(), "body": body}).encode()))
    assert HistoryStore.load(tmp_path / "big.json.gz", max_bytes=1000).prompts == {}
    assert "unzips to more than 1000 bytes" in caplog.text


@pytest.fixture(scope="module")
def saved_run(base_model, tmp_path_factory):
    """A tiny run with checkpoints, and an RLRun over it to restore them into."""
    from rhymerl.training.rl import RLRun, train

    from tests.helpers import rl_overrides

    run = tmp_path_factory.mktemp("ckrun") / "run"
    cfg = load_config(None, rl_overrides(base_model, run) + ["trainer.steps=2", "trainer.eval_every=100"])
    train(cfg, progress=False)
    rl = RLRun(cfg, run, progress=False)
    yield run, rl
    rl.close()


def _restored(rl) -> tuple:
    """What a restore put into the run: its step, loader position and weights."""
    return rl.step, json.dumps(rl.data.loader.state_dict(), sort_keys=True), \
        [p.detach().clone() for p in rl.model.parameters()]


@pytest.fixture(scope="module")
def intact(saved_run):
    from rhymerl.training.checkpoint import latest_checkpoint

    run, rl = saved_run
    rl._restore(latest_checkpoint(run))
    return _restored(rl)


@FUZZ
@given(data=st.data())
def test_fuzzed_checkpoint_folders_restore_the_same_state_or_raise_checkpoint_error(saved_run, intact, data,
                                                                                    tmp_path_factory):
    from rhymerl.training.checkpoint import MANIFEST, CheckpointError, file_digests, latest_checkpoint

    run, rl = saved_run
    src = latest_checkpoint(run)
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())  # every file a resume reads
    dst = tmp_path_factory.mktemp("ck") / "checkpoints" / src.name
    shutil.copytree(src, dst)
    for _ in range(data.draw(st.integers(1, 2))):
        name = data.draw(st.sampled_from(files))
        f = dst / name
        how = data.draw(st.sampled_from(["delete", "truncate", "flip", "json"]))
        if how == "delete":
            f.unlink(missing_ok=True)
        elif how == "truncate" and f.exists():
            b = f.read_bytes()
            f.write_bytes(b[: data.draw(st.integers(0, max(0, len(b) - 1)))])
        elif how == "flip" and f.exists() and f.stat().st_size:
            b = bytearray(f.read_bytes())
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= data.draw(st.integers(1, 255))
            f.write_bytes(bytes(b))
        elif how == "json" and name.endswith(".json") and isinstance(json.loads((src / name).read_text()), dict):
            base = json.loads((src / name).read_text())
            key = data.draw(st.sampled_from(sorted(base) or ["k"]))
            base[key] = data.draw(json_values)
            f.write_text(json.dumps(base))
    # Resealed: the manifest rewritten over the damage (as a buggy writer would), so the
    # readers behind it are fuzzed too; unsealed, the manifest alone must refuse it.
    resealed = data.draw(st.booleans())
    if resealed:
        (dst / MANIFEST).write_text(json.dumps(file_digests(dst)))
    changed = file_digests(dst) != file_digests(src)
    try:
        rl._restore(dst)
    except Exception as e:  # noqa: BLE001 - the assertion is on the type
        assert isinstance(e, CheckpointError), f"{type(e).__name__}: {e}"
        assert str(dst) in str(e)
        return
    # restored: an unsealed change never gets here (the manifest refuses it); an unchanged
    # folder restores exactly the intact state; a resealed change restores a state the run can use
    assert resealed or not changed, "a changed checkpoint restored without its manifest refusing it"
    step, loader, weights = _restored(rl)
    if not changed:
        assert (step, loader) == intact[:2] and all(torch.equal(a, b) for a, b in zip(weights, intact[2]))
    else:
        rl.data.loader.next_batch()  # the loader position it restored is one the run can continue from
