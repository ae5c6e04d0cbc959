"""Never break training: our code around verl's runs behind these two helpers.

``quietly`` runs one piece of our code (opening a span, injecting a carrier) and, if it raises,
logs it once per place and returns a default: verl's code never sees our exception.
``cannot_patch`` is the one warning per verl module whose names we could not find (another verl
version): that part of verl is left as it is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

logger = logging.getLogger("otel_tracking.verl")
T = TypeVar("T")

_lock = threading.Lock()
_reported: set[str] = set()


def quietly(where: str, func: Callable[..., T], *args: Any, default: Any = None) -> T | Any:
    try:
        return func(*args)
    except Exception as exc:
        failed(where, exc)
        return default


def failed(where: str, exc: Exception) -> None:
    """What ``quietly`` does with an exception, for a hot path that catches its own."""
    with _lock:
        first = where not in _reported
        _reported.add(where)
    if first:  # once per place: a wrapper on a hot path must not flood the log
        logger.warning("otel-tracking: %s failed (%s: %s); verl continues without it", where, type(exc).__name__, exc)


def cannot_patch(module: str, names: Iterable[str], why: str = "not found") -> None:
    names = list(names)
    if names:
        logger.warning(
            "otel-tracking: could not instrument %s (%s in this verl version); that part of verl is left as it is",
            ", ".join(f"{module}.{name}" for name in names),
            why,
        )
