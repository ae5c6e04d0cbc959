"""A phase is the parent of the work it hands to other threads.

OpenTelemetry's current span lives in a ``contextvars`` context.  An asyncio task copies its
creator's context, so a span it starts nests under the phase that created it; a thread does not:
``pool.map(generate, ...)`` inside ``trace_state("rollout")`` runs ``generate`` in a pool thread
with an empty context, and its span would hang under the step's root (or a worker's trace) instead
of ``rollout``.  Nothing here patches ``concurrent.futures`` or ``threading``: instead each run
remembers, per thread, the phases open there, and a span that starts in a worker thread of a
``concurrent.futures.ThreadPoolExecutor`` (asyncio's default executor is one) with no phase of its
own and no current span takes as its parent the phase open in the *one* other thread that has
phases open: that thread's innermost phase, or, where that thread runs several phases at once
(asyncio lanes under ``rollout``), the innermost phase they all run under.  A thread of the
application's own (``threading.Thread``) is never given a parent this way: it may be a loop of
its own beside the training loop.

What it cannot tell, it does not guess: when phases are open in several other threads (two training
threads, each with a pool), the span starts where it would have (the step's root) and one warning
says how to make it right: submit ``contextvars.copy_context().run`` (or ``asyncio.to_thread``,
which copies the context).  A pool thread whose phase was given a parent this way is the phase's
helper while that phase is open: its spans are no parent for other threads.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("otel_tracking")


@dataclass(eq=False)
class _Open:
    """A phase open in a thread: one that owns its phases, or a helper (``adopted``)."""

    span: Any
    thread: int
    parent: _Open | None = None  # the open phase of the same thread it nests under, if any
    children: int = 0  # open phases of the same thread directly under it
    adopted: bool = False  # its parent came from another thread


class ThreadParents:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[int, dict[int, _Open]] = {}  # thread that owns its phases -> id(span) -> entry
        self._helpers: dict[int, int] = {}  # helper thread -> how many adopted phases it has open
        self._warned = False

    def parent_for(self, thread: int, name: str) -> Any | None:
        """The span a phase starting now in pool thread ``thread`` (see :func:`in_pool_thread`)
        with no current span hangs under: the phase open in the one other thread with phases
        open; None when ``thread`` has phases of its own, no other thread has, or several have
        (said once)."""
        if not self._threads:
            return None
        with self._lock:
            if thread in self._threads or thread in self._helpers:
                return None
            others = list(self._threads.values())
            if len(others) > 1:
                ambiguous = len(others)
            else:
                return _trunk_tip(others[0])
        self._warn_once(name, ambiguous)
        return None

    def opened(self, span: Any, thread: int, current: Any | None, adopted: bool) -> _Open | None:
        """Note ``span``, started in ``thread`` under ``current`` (the span current there, None for
        none); ``adopted``: its parent came from :meth:`parent_for`, which makes ``thread`` a helper
        while it is open (its phases are no parent for other threads).  The entry to hand to
        :meth:`closed`, or None."""
        with self._lock:
            if adopted:
                self._helpers[thread] = self._helpers.get(thread, 0) + 1
                return _Open(span, thread, adopted=True)
            if thread in self._helpers:
                return None
            phases = self._threads.setdefault(thread, {})
            parent = phases.get(id(current)) if current is not None else None
            entry = _Open(span, thread, parent)
            if parent is not None:
                parent.children += 1
            phases[id(span)] = entry
            return entry

    def closed(self, entry: _Open) -> None:
        with self._lock:
            if entry.adopted:
                left = self._helpers.pop(entry.thread, 1) - 1
                if left > 0:
                    self._helpers[entry.thread] = left
                return
            phases = self._threads.get(entry.thread)
            if phases is None or phases.pop(id(entry.span), None) is None:
                return
            if entry.parent is not None:
                entry.parent.children -= 1
            if not phases:
                del self._threads[entry.thread]

    def _warn_once(self, name: str, threads: int) -> None:
        if self._warned:
            return
        self._warned = True
        from otel_tracking.signals.redact import scrub_value

        logger.warning(
            "otel-tracking: trace_state(%r) started in a thread with no phase of its own while phases are open in "
            "%d other threads: it cannot tell which one handed it the work, so it hangs under the step's root. "
            "Submit contextvars.copy_context().run(fn, ...) to the pool (or use asyncio.to_thread) to nest it "
            "under its phase; further cases are not reported",
            scrub_value(name),
            threads,
        )


_pool_worker: Any = None  # concurrent.futures.thread._worker, the target of every pool thread


def in_pool_thread() -> bool:
    """Whether this thread is a ``ThreadPoolExecutor``'s worker: its target is the standard
    library's worker loop (Python 3.9-3.13), or, should that name change, its name is the
    executor's default one."""
    global _pool_worker
    if _pool_worker is None:
        import concurrent.futures.thread as pool_module

        _pool_worker = getattr(pool_module, "_worker", False)
    thread = threading.current_thread()
    if _pool_worker and getattr(thread, "_target", None) is _pool_worker:
        return True
    return thread.name.startswith(("ThreadPoolExecutor-", "asyncio_"))


def _trunk_tip(phases: dict[int, _Open]) -> Any | None:
    """The innermost phase every open phase of one thread runs in (or under): from the thread's
    outermost phase down, as long as one phase is open directly under it."""
    tops = [entry for entry in phases.values() if entry.parent is None]
    if len(tops) != 1:
        return None  # several top-level phases at once (asyncio tasks of their own): none is the one
    tip = tops[0]
    while tip.children == 1:
        tip = next(entry for entry in phases.values() if entry.parent is tip)
    return tip.span
