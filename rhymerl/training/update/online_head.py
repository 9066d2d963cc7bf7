"""What the heads trained beside the policy share: hooks on the policy keep its hidden states
only inside :meth:`OnlineHead.watching` (the trainer's forward), never in other forwards."""
from __future__ import annotations

import contextlib
from typing import Iterator


class OnlineHead:
    _on = False  # set inside watching(): the hooks keep what the policy forward computes

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Keep the hidden states of the policy forwards run inside."""
        self._on = True
        try:
            yield
        finally:
            self._on = False
