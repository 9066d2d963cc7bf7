"""``additional_config["rhymerl"]``: what a vLLM engine tells HistoSpecProposer, as one typed
object. :class:`rhymerl.vllm.engine.VllmEngine` writes it and the proposer reads it; an
unknown key (a typo such as ``historydir``) or a value of the wrong type is refused by name."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from rhymerl.drafting.config import checked_fields

HISTORY_TOKENS = 10_000_000  # the recorded history's default token budget (about 0.4 GB as Python lists)
WHERE = 'additional_config["rhymerl"]'


@dataclass(frozen=True)
class ProposerSettings:
    history: str | None = None  # a history file a rhymerl run wrote (RUN/checkpoints/step_N/history.json.gz)
    history_tokens: int = HISTORY_TOKENS  # the recorded history's token budget
    record: bool = True  # record each finished response under its prompt's key
    history_dir: str | None = None  # a folder several engines share (rhymerl.vllm.shared_history)
    history_sync_s: float = 5.0  # the shared folder is written and read at most this often
    history_dir_bytes: int = 1 << 30  # the shared folder is kept under this size
    speculative: dict = field(default_factory=dict)  # rhymerl.drafting.SpecConfig fields

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> "ProposerSettings":
        values = dict(values or {})
        if "draft_gate" in values:
            raise ValueError(f"{WHERE}['draft_gate'] is gone; {WHERE}['speculative']['gate'] (on by default) decides "
                             "how far each row drafts")
        s = cls(**checked_fields(cls, values, WHERE))
        if s.history_tokens <= 0 or s.history_dir_bytes <= 0 or s.history_sync_s < 0:
            raise ValueError(f"{WHERE}: history_tokens and history_dir_bytes must be > 0 and history_sync_s >= 0, "
                             f"got {s.history_tokens}, {s.history_dir_bytes}, {s.history_sync_s}")
        if s.history is not None and not Path(s.history).is_file():
            raise ValueError(f"{WHERE}['history']: {s.history}: no such file (a rhymerl run's history.json.gz)")
        return s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
