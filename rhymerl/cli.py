"""``rhymerl``: the command line.

    rhymerl train [CONFIG.yaml] [key=value ...] [--resume RUN_DIR [trainer.world_size=N ...]]
    rhymerl sft   [CONFIG.yaml] [key=value ...]
    rhymerl bench {engine,spec,e2e,pipe,train,project,trl} [--json FILE] [--quick]
    rhymerl export RUN_DIR [--out DIR] [--force]
    rhymerl config [--markdown]           every configuration key, its default and meaning
"""
from __future__ import annotations

import argparse
import sys

from rhymerl.config import ConfigError, load_config
from rhymerl.rollout_engines import BACKENDS, ENGINES


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    cfg = None
    overrides = []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif cfg is None and a.endswith((".yaml", ".yml")):
            cfg = a
        else:
            raise ConfigError(f"{a}: expected a .yaml config file or a key=value override")
    return cfg, overrides


def cmd_sft(ns: argparse.Namespace) -> int:
    from rhymerl.training.sft import draft_config, print_card, run_sft, sft_output_dir

    cfg = load_config(*_split(ns.args))
    if ns.draft:
        cfg = draft_config(cfg)
    out = sft_output_dir(cfg)
    print_card(run_sft(cfg, out), out)
    return 0


def cmd_train(ns: argparse.Namespace) -> int:
    from rhymerl.training.rl import train

    cfg_path, overrides = _split(ns.args)
    if ns.resume:
        if cfg_path:
            raise SystemExit(f"--resume takes the run folder's own config; drop {cfg_path}")
        return train(resume=ns.resume, resume_overrides=overrides, accept_changed_inputs=ns.accept_changed_inputs)
    return train(load_config(cfg_path, overrides), config_path=cfg_path, accept_changed_inputs=ns.accept_changed_inputs)


def _given(ns: argparse.Namespace, *keys: str) -> dict:
    """The options among ``keys`` the command line set."""
    return {k: getattr(ns, k) for k in keys if getattr(ns, k)}


def _csv(value: str | None, cast=str) -> tuple | None:
    return tuple(cast(v) for v in value.split(",")) if value else None


def _bench_engine(ns: argparse.Namespace) -> None:
    from rhymerl.bench.engine import run

    run(ns.json, quick=ns.quick)


def _bench_spec(ns: argparse.Namespace) -> None:
    kw: dict = {"methods": _csv(ns.methods), "temperatures": _csv(ns.temperatures, float)}
    if ns.engine == "vllm":
        from rhymerl.bench.vllm_spec import run

        kw |= _given(ns, "model", "prompts", "n", "max_tokens", "top_p", "max_num_seqs", "task")
        kw |= {"epochs": max(_csv(ns.epochs, int)) if ns.epochs else None, "rounds": ns.reps,
               "width": ns.model_width}
    else:
        from rhymerl.bench.spec import run

        kw |= _given(ns, "max_num_seqs", "prompts", "n", "max_tokens", "model", "draft_model", "draft_head",
                     "task", "top_p")
        kw |= {"gates": None if ns.gate == "both" else (ns.gate == "on",), "reps": ns.reps,
               "epochs": _csv(ns.epochs, int)}
    run(ns.json, quick=ns.quick, **{k: v for k, v in kw.items() if v is not None})


def _bench_e2e(ns: argparse.Namespace) -> None:
    from rhymerl.bench.e2e import run

    run(ns.json, quick=ns.quick, only=_csv(ns.variants))


def _bench_pipe(ns: argparse.Namespace) -> None:
    from rhymerl.bench.pipe import run

    run(ns.json, quick=ns.quick, traces=ns.traces, speculation=not ns.no_speculation,
        measured=not ns.simulated_only, engine=ns.engine, rounds=ns.reps)


def _bench_train(ns: argparse.Namespace) -> None:
    from rhymerl.bench.train import run

    run(ns.json, quick=ns.quick, backend=ns.backend)


def _bench_project(ns: argparse.Namespace) -> None:
    from rhymerl.bench.project import run

    run(ns.json, quick=ns.quick)


def _bench_trl(ns: argparse.Namespace) -> None:
    from rhymerl.bench.trl_histospec import run

    kw = _given(ns, "task", "prompts", "max_tokens", "top_p", "batch_prompts")
    kw |= {k: v for k, v in {"generations": ns.n, "temperature": _csv(ns.temperatures, float),
                             "epochs": max(_csv(ns.epochs, int)) if ns.epochs else None}.items() if v}
    if "temperature" in kw:
        kw["temperature"] = kw["temperature"][0]
    run(ns.json, quick=ns.quick, model=ns.model, rounds=ns.reps or 5,
        variants=_csv(ns.variants) or ("plain", "histospec"), **kw)


# The benchmarks, by name: what each measures (every one prints ratios against a baseline timed
# in the same run, and machine-independent counts), and the function that runs it.
BENCHES = {
    "engine": ("our engine against Hugging Face generate on the same weights (with and without invariant "
               "numerics)", _bench_engine),
    "spec": ("every draft method and its peers on the same rollout traces (same tokens; forwards and time)",
             _bench_spec),
    "e2e": ("the same short RL run with speculation, HistoPipe, async or streaming against the plain loop",
            _bench_e2e),
    "pipe": ("HistoPipe against even split, least-loaded routing and oracles, measured and simulated", _bench_pipe),
    "train": ("the policy update on 1 and 2 trainer ranks, FSDP2 and DDP, on the same batch", _bench_train),
    "project": ("what HistoSpec, HistoPipe and async RL would do to a whole step on GPU clusters (a model)",
                _bench_project),
    "trl": ("TRL's GRPOTrainer (vLLM colocate) with HistoSpec against the same run without (optional extra: trl)",
            _bench_trl),
}


def cmd_bench(ns: argparse.Namespace) -> int:
    BENCHES[ns.which][1](ns)
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from rhymerl.training.checkpoint import export_policy

    out = export_policy(ns.run_dir, ns.out, force=ns.force)
    print(f"exported {out}")
    return 0


def cmd_config(ns: argparse.Namespace) -> int:
    from rhymerl.config_reference import markdown, reference

    if ns.markdown:
        print(markdown(), end="")
        return 0
    for key, tp, default, note in reference():
        print(f"{key} = {default!r}  ({tp}){'  # ' + note if note else ''}")
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors the project raises on purpose: their message says what and where, so the command
    line prints it alone (a traceback only with --debug)."""
    from rhymerl.data.dataset import DatasetError
    from rhymerl.distribution.backends import InsecureClusterError
    from rhymerl.distribution.work import WorkerLost
    from rhymerl.rewards.pool import RewardLoadError
    from rhymerl.training.checkpoint import CheckpointError
    from rhymerl.training.rollout.engine_checks import LogpGapError
    from rhymerl.training.rollout.policy_versions import RolloutTimeout
    from rhymerl.vllm.engine import LossySamplerError, VllmUnavailable, WeightSyncError
    from rhymerl.vllm.watchdog import EngineLost, EngineTimeout
    from rhymerl.training.rollout.phase import RewardFunctionError
    from rhymerl.training.update.trainer_group import TrainerRankError

    return (ConfigError, DatasetError, CheckpointError, RewardFunctionError, RewardLoadError, TrainerRankError,
            WorkerLost, InsecureClusterError, LogpGapError, RolloutTimeout, VllmUnavailable, LossySamplerError,
            WeightSyncError, EngineTimeout, EngineLost)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rhymerl", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--debug", action="store_true", help="print tracebacks of expected errors too")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="RL training (builds the SFT base model first if needed)")
    t.add_argument("args", nargs="*", help="CONFIG.yaml and/or key=value overrides")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--accept-changed-inputs", action="store_true",
                   help="resume even though the base model, reward file or data changed since the run started")
    t.set_defaults(fn=cmd_train)
    s = sub.add_parser("sft", help="train the tiny base model of a built-in task from scratch")
    s.add_argument("args", nargs="*")
    s.add_argument("--draft", action="store_true",
                   help="a small draft model instead (for rollout.speculative.draft_model)")
    s.set_defaults(fn=cmd_sft)
    _add_bench(sub)
    c = sub.add_parser("config", help="list every configuration key with its default and meaning")
    c.add_argument("--list", action="store_true", help="(the default) one key a line")
    c.add_argument("--markdown", action="store_true", help="the table of docs/config.md")
    c.set_defaults(fn=cmd_config)
    e = sub.add_parser("export", help="write a run's final policy as an HF folder")
    e.add_argument("run_dir")
    e.add_argument("--out")
    e.add_argument("--force", action="store_true", help="replace --out if it exists")
    e.set_defaults(fn=cmd_export)
    return p


def _add_bench(sub: "argparse._SubParsersAction") -> None:
    """`rhymerl bench WHICH` and its options."""
    b = sub.add_parser("bench", help="benchmarks: ratios against a baseline measured in the same run",
                       formatter_class=argparse.RawTextHelpFormatter)
    b.add_argument("which", choices=list(BENCHES),
                   help="\n".join(f"{name}: {what}" for name, (what, _) in BENCHES.items()))
    b.add_argument("--json", metavar="FILE")
    b.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    b.add_argument("--engine", choices=list(ENGINES), default="native",
                   help="spec: the engine the methods run in (vllm: ngram, suffix, history inside vLLM); "
                        "pipe: the measured workers' engine")
    b.add_argument("--max-num-seqs", type=int, help="spec: sequences in flight (default: native 64; "
                                                     "vllm every sample of the prompts, up to 256)")
    b.add_argument("--task", help="spec: the built-in task whose prompts are generated (default: the main "
                                  "job's, arith; chat_sums for a chat model such as smollm2)")
    b.add_argument("--prompts", type=int, help="spec: how many prompts (default: native 32, vllm 64); "
                                                "trl: the dataset's size (default 16)")
    b.add_argument("--batch-prompts", type=int, help="trl: prompts a step (default 4)")
    b.add_argument("--n", type=int, help="spec: samples per prompt (default 8)")
    b.add_argument("--max-tokens", type=int, help="spec: response length cap (default 160)")
    b.add_argument("--gate", choices=["both", "on", "off"], default="both",
                   help="spec: rows with the batch gate, without it (the draft sources alone), or both")
    b.add_argument("--model", help="spec: the target, an HF folder, a GGUF file or a named model (smollm2) "
                                   "(default: the main job's newest policy, or its base)")
    b.add_argument("--draft-model", help="spec: a draft model folder (default: the task's, trained if missing)")
    b.add_argument("--draft-head", help="spec: a saved draft head (default: the main job's newest checkpoint's)")
    b.add_argument("--methods", help="spec: comma-separated subset of the methods")
    b.add_argument("--temperatures", help="spec: comma-separated (default 1.0,0.6)")
    b.add_argument("--model-width", help="spec --engine vllm: the policy zero-padded to a larger model's size "
                                          "(same logits, that model's forward; rhymerl.model.widen: 22m)")
    b.add_argument("--top-p", type=float, help="spec: nucleus sampling's top-p (default 1.0)")
    b.add_argument("--epochs", help="spec: the measured epochs, comma-separated (default 1,3)")
    b.add_argument("--reps", type=int, help="spec: timed rounds (native: of the gated rows; vllm: of every row), methods in turn (default 5); "
                        "pipe: measured rounds, policies in turn (default 5)")
    b.add_argument("--variants", help="e2e: comma-separated subset (the baseline and what they are compared "
                                      "with always run); trl: plain,histospec (default), histospec_no_siblings")
    b.add_argument("--traces", metavar="FILE", help="pipe: a run's traces.jsonl (default: the main job's, if any)")
    b.add_argument("--no-speculation", action="store_true",
                   help="pipe: measure the local runs with speculation off only (skips the HistoSpec-on table)")
    b.add_argument("--simulated-only", action="store_true",
                   help="pipe: the simulated table alone (no local runs; the built-in task's rows need its traces)")
    b.add_argument("--backend", choices=list(BACKENDS), default="local",
                   help="train: where the trainer ranks run (local processes or Ray actors)")
    b.set_defaults(fn=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        return ns.fn(ns)
    except Exception as e:  # noqa: BLE001 - sorted below: expected errors in one line, the rest re-raised
        if ns.debug or not isinstance(e, _user_errors()):
            raise
        kind = "config error" if isinstance(e, ConfigError) else type(e).__name__
        print(f"rhymerl: {kind}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
