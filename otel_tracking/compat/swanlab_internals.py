"""SwanLab's private names, named here and nowhere else: a step's event emitted as ``run.log`` would.

SwanLab's ``run.log`` checks every value of a step (a flatten, a context manager and a pydantic
key check per value) before it emits one event for SwanLab's writer thread, in the one GIL that
thread needs too.  A training run's steps are plain numbers under the same keys step after step:
for those, :class:`FastSteps` emits the event ``run.log`` would emit, under the run's lock, with
its step and a timestamp, once each key has been through SwanLab's own key check unchanged.
Anything else (a table, a NumPy number, a key SwanLab trims or rejects, a finished run) goes
through ``run.log``.  :data:`PRIVATE_NAMES` lists the names this needs; :meth:`FastSteps.of` says
once per process, at debug, which path runs and why, and warns once when a release it was checked
against lacks one.  ``tests/test_swanlab_steps.py`` is the contract: the stored records equal
``run.log``'s, and a name taken away falls back.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any

from otel_tracking.compat._said import SaidOnce, tested_release

logger = logging.getLogger("otel_tracking.swanlab")
_say = SaidOnce(
    logger, "otel-tracking: SwanLab steps: %s", "otel-tracking: SwanLab's %s; every step goes through run.log"
)

# The SwanLab releases whose run.log this was checked against (tests/test_swanlab_steps.py).
TESTED_RELEASES = ((0, 10),)

# Each private name, by what holds it; without any, every step goes through run.log.
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "swanlab run": ("_api_lock", "_ctx", "_ctx.next_step", "_components.emitter.emit", "alive"),
    "swanlab.sdk.internal.bus": ("MetricLogEvent",),
    "swanlab.sdk.internal.run.fmt": ("validate_key",),
}

_NUMBERS = (float, int, bool)


def tested_version(swanlab: Any) -> bool:
    return tested_release(swanlab, TESTED_RELEASES)


def _holds(holder: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(holder, part):
            return False
        holder = getattr(holder, part)
    return True


def missing(run: Any) -> list[str]:
    """The private names of :data:`PRIVATE_NAMES` that this run or SwanLab's modules lack."""
    lacking = []
    for where, names in PRIVATE_NAMES.items():
        try:
            holder = run if where == "swanlab run" else importlib.import_module(where)
        except ImportError:
            lacking.append(where)
            continue
        lacking += [f"{where}.{name}" for name in names if not _holds(holder, name)]
    return lacking


class FastSteps:
    """Emits a step of plain numbers as SwanLab's ``run.log`` would."""

    def __init__(self, run: Any, event: Any, timestamp: Any, validate_key: Any) -> None:
        self.run = run
        self._event = event
        self._timestamp = timestamp
        self._validate_key = validate_key
        self._emit = run._components.emitter.emit
        self._kept: set[str] = set()  # keys SwanLab's key check returned unchanged

    @classmethod
    def of(cls, run: Any) -> FastSteps | None:
        """The fast path for ``run``, or None (and why, said once) when this is not the SwanLab it
        was written for."""
        import swanlab

        release = getattr(swanlab, "__version__", "?")
        if not tested_version(swanlab):
            _say(f"run.log for every step: SwanLab {release} is not a release this was checked against "
                 f"{TESTED_RELEASES}")  # fmt: skip
            return None
        lacking = missing(run)
        if lacking:
            _say(f"release {release} lacks {', '.join(lacking)}", moved=True)
            return None
        from google.protobuf.timestamp_pb2 import Timestamp
        from swanlab.sdk.internal.bus import MetricLogEvent
        from swanlab.sdk.internal.run import fmt

        _say("steps of plain numbers emitted as run.log would, the rest through run.log")
        return cls(run, MetricLogEvent, Timestamp, fmt.validate_key)

    def emit(self, data: Mapping[str, Any], step: int) -> bool:
        """Emit ``data`` at ``step``; False (nothing emitted) unless run.log would emit it as it is."""
        if type(step) is not int or step < 0:
            return False
        kept = self._kept
        for key, value in data.items():
            if type(value) not in _NUMBERS:
                return False
            if key not in kept and not self._keeps(key):
                return False
        run = self.run
        with run._api_lock:
            if not run.alive:
                return False
            next_step = run._ctx.next_step(step)
            timestamp = self._timestamp()
            timestamp.GetCurrentTime()
            self._emit(self._event(data=dict(data), step=next_step, timestamp=timestamp))
        return True

    def _keeps(self, key: Any) -> bool:
        if type(key) is not str:
            return False
        try:
            same = self._validate_key(key) == key
        except Exception:  # rejected: run.log says so
            return False
        if same:
            self._kept.add(key)
        return same
