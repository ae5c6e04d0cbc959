"""verl's private names, named here and nowhere else: where the switch hooks into verl.

verl has no public hook for the two places the instrumentation needs, so the switch (``verl/``)
replaces two of its private functions, and reads one private attribute where the public one is
missing:

* ``RayWorkerGroup._execute_remote_single_worker`` (``verl.single_controller.ray.base``): every
  worker-group call the driver sends to one worker goes through it, so that is where the call gets
  its carrier and where the driver learns whom it waits for;
* ``_timer`` (``verl.utils.profiler.performance``): every ``marked_timer`` (and ``simple_timer``)
  yields from it at call time, so replacing it opens a span for each of verl's phases;
* a worker group's ``_workers`` list, only when it has no public ``workers`` (verl 0.9 has both).

:data:`PRIVATE_NAMES` lists them and :data:`TESTED_RELEASES` the verl releases they were checked
against; each lookup says once per process at debug which path runs, and returns None where
this verl lacks the name (the switch then warns that it left that part of verl as it is).
``tests/verl/test_verl_internals.py`` is the contract with the pinned verl.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from otel_tracking.compat._said import SaidOnce, tested_release

logger = logging.getLogger("otel_tracking.verl")
_say = SaidOnce(logger, "otel-tracking: verl: %s", "otel-tracking: verl %s")

# The verl releases whose private names these were checked against.
TESTED_RELEASES = ((0, 9),)

WORKER_GROUP_MODULE = "verl.single_controller.ray.base"
TIMER_MODULE = "verl.utils.profiler.performance"
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    WORKER_GROUP_MODULE: ("RayWorkerGroup._execute_remote_single_worker",),
    TIMER_MODULE: ("_timer",),
}
_EXECUTE = "_execute_remote_single_worker"


def tested_version() -> bool:
    """Whether the installed verl is a release these names were checked against."""
    try:
        import verl
    except ImportError:
        return False
    return tested_release(verl, TESTED_RELEASES)


def _missing(where: str) -> None:
    _say(f"has no {where}" + (", though this release was checked to have it" if tested_version() else ""))


def worker_group_execute(base: ModuleType) -> tuple[type, Callable[..., Any]] | None:
    """``RayWorkerGroup`` and its ``_execute_remote_single_worker`` in ``base`` (verl's
    ``single_controller.ray.base``), or None (said once) where this verl has neither."""
    group = getattr(base, "RayWorkerGroup", None)
    execute = getattr(group, _EXECUTE, None)
    if group is None or not callable(execute):
        _missing(f"{base.__name__}.RayWorkerGroup.{_EXECUTE}")
        return None
    _say(f"worker-group calls through {base.__name__}.RayWorkerGroup.{_EXECUTE}")
    return group, execute


def replace_worker_group_execute(group: type, execute: Callable[..., Any]) -> None:
    setattr(group, _EXECUTE, execute)


def performance_timer(performance: ModuleType) -> Callable[..., Any] | None:
    """verl's ``_timer`` in ``performance``, or None (said once) where this verl has none."""
    timer = getattr(performance, "_timer", None)
    if not callable(timer):
        _missing(f"{performance.__name__}._timer")
        return None
    _say(f"marked_timer phases through {performance.__name__}._timer")
    return timer


def replace_performance_timer(performance: ModuleType, timer: Callable[..., Any]) -> None:
    performance._timer = timer  # type: ignore[attr-defined]


def workers_of(group: Any) -> Sequence[Any]:
    """A worker group's worker handles, in rank order: its public ``workers``, else ``_workers``."""
    workers = getattr(group, "workers", None)
    if workers is None:
        workers = getattr(group, "_workers", None)
    return workers or ()


# Each group's worker -> rank map, made once per group and size: a worker-group call looks its
# worker up at every call, and a group of 1,024 workers would otherwise be searched 1,024 times per
# step phase.
_ranks: weakref.WeakKeyDictionary[Any, tuple[int, dict[int, int]]] = weakref.WeakKeyDictionary()


def rank_in_group(group: Any, worker: Any) -> tuple[int, int]:
    """(``worker``'s rank in ``group``, the group's size); rank -1 for a worker not in it."""
    workers = workers_of(group)
    rank = _rank_map(group, workers).get(id(worker), -1)
    if rank < 0 or workers[rank] is not worker:  # not found, or the list changed in place
        rank = _rank_map(group, workers, fresh=True).get(id(worker), -1)
    return rank, len(workers)


def _rank_map(group: Any, workers: Sequence[Any], fresh: bool = False) -> dict[int, int]:
    try:
        size, ranks = _ranks[group]
    except (KeyError, TypeError):
        size, ranks = -1, {}
    if fresh or size != len(workers):
        ranks = {id(w): i for i, w in enumerate(workers)}
        with contextlib.suppress(TypeError):  # a group that takes no weak reference: made anew each call
            _ranks[group] = (len(workers), ranks)
    return ranks
