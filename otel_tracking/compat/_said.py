"""What the library modules of ``compat`` share: which release of a library was checked, and saying
once per process which path runs and why."""

from __future__ import annotations

import logging
import threading
from typing import Any


def tested_release(module: Any, releases: tuple[tuple[int, int], ...]) -> bool:
    """Whether ``module.__version__`` is one of ``releases`` (major, minor)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(module.__version__)).release[:2] in releases
    except (AttributeError, InvalidVersion):
        return False


class SaidOnce:
    """Says each reason once per process: at debug (``debug % reason``), or as a warning
    (``moved % reason``) when a release it was checked against lacks a private name."""

    def __init__(self, logger: logging.Logger, debug: str, moved: str) -> None:
        self.logger, self.debug, self.moved = logger, debug, moved
        self.said: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, reason: str, moved: bool = False) -> None:
        with self._lock:
            if reason in self.said:
                return
            self.said.add(reason)
        if moved:
            self.logger.warning(self.moved, reason)
        else:
            self.logger.debug(self.debug, reason)
