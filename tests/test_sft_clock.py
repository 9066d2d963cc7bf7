"""The built-in base does not depend on the machine's speed (issue 60)."""
from __future__ import annotations

import itertools

from rhymerl.config import load_config
from rhymerl.training.sft import run_sft, short_base

from tests.helpers import TINY


def _hour_per_tick():
    ticks = itertools.count()
    return lambda: 3600.0 * next(ticks)  # every read of the clock an hour later: a very slow machine


def test_the_base_trains_its_configured_steps_however_slow_the_clock(tmp_path):
    card = run_sft(load_config(None, TINY + ["sft.steps=12"]), tmp_path / "base", progress=False,
                   clock=_hour_per_tick())
    assert card["steps"] == 12 and not card["stopped_early_for_time"] and short_base(card) is None


def test_an_opt_in_time_limit_that_cuts_the_base_says_so(tmp_path, capsys):
    from rhymerl.training.sft import print_card

    card = run_sft(load_config(None, TINY + ["sft.steps=12", "sft.max_minutes=90"]), tmp_path / "base",
                   progress=False, clock=_hour_per_tick())
    assert card["steps"] == 1 and card["stopped_early_for_time"]
    print_card(card, tmp_path / "base")
    assert "WARNING: the base trained 1 of its 12 SFT steps (sft.max_minutes cut it)" in capsys.readouterr().out
