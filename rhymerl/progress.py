"""Progress for a terminal or a log file: a tqdm bar when stderr is a terminal; otherwise one
plain line every so many steps (a redirected bar writes thousands of frames into the log)."""
from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator


class LineProgress:
    """tqdm's few methods used here, printing ``desc n/total k=v ...`` about ``lines`` times."""

    def __init__(self, iterable: Iterable[Any], *, desc: str, total: int, initial: int = 0, lines: int = 20,
                 stream: Any = None) -> None:
        self.iterable, self.desc, self.total, self.n = iterable, desc, total, initial
        self.every = max(1, -(-total // lines))  # at most about `lines` lines, the last step always
        self.postfix: dict[str, Any] = {}
        self.stream = stream or sys.stdout
        self.t0 = time.perf_counter()

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable:
            yield item
            self.n += 1
            if self.n % self.every == 0 or self.n == self.total:
                self._line()

    def set_postfix(self, **kw: Any) -> None:
        self.postfix = kw

    def _line(self) -> None:
        extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        print(f"{self.desc} {self.n}/{self.total} ({time.perf_counter() - self.t0:.0f}s) {extra}".rstrip(),
              file=self.stream, flush=True)

    def close(self) -> None:
        pass


def progress(iterable: Iterable[Any], *, desc: str, total: int, enabled: bool = True, initial: int = 0):
    """A bar on a terminal, lines in a log, nothing when not ``enabled``."""
    if enabled and not sys.stderr.isatty():
        return LineProgress(iterable, desc=desc, total=total, initial=initial)
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, initial=initial, disable=not enabled)
