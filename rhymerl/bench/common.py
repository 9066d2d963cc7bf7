"""What every ``rhymerl bench ...`` shares: the JSON shape and a description of the machine."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rhymerl.device import machine_info


def write_report(rows: list[dict[str, Any]], path: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"rows": [...], "machine": {...}}`` plus ``extra``, written to ``path`` when given."""
    report = {"rows": rows, "machine": machine_info(), **(extra or {})}
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))
