"""What every ``rhymerl bench ...`` shares: the JSON shape and a description of the machine."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


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
