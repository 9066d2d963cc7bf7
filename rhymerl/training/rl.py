"""The main job: ``rhymerl train``."""
from __future__ import annotations

import json
from pathlib import Path

from rhymerl.config import RunConfig, load_config
from rhymerl.training.sft import CARD, run_sft, sft_output_dir


def ensure_base_model(cfg: RunConfig) -> Path:
    """The policy to start from: ``model.path``, or the task's SFT base (trained if missing)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    out = sft_output_dir(cfg)
    card_path = out / CARD
    if card_path.exists():
        card = json.loads(card_path.read_text())
        print(f"base model: reusing {out} (held-out greedy accuracy "
              f"{100 * card['heldout_greedy_accuracy']:.1f}%)")
        return out
    print(f"base model: none at {out}; training it from scratch (rhymerl sft)")
    from rhymerl.cli import _print_card

    card = run_sft(cfg, out)
    _print_card(card, out)
    return out


def train(cfg: RunConfig | None = None, *, resume: str | None = None, config_path: str | None = None) -> int:
    cfg = cfg or load_config()
    ensure_base_model(cfg)
    return 0
