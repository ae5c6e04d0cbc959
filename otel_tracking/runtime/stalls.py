"""Stall reports: a phase that outlives its bound is said while it is stuck, with where it is stuck.

OpenTelemetry exports a span when it *ends*, so a ``trace_state`` phase that never ends (a rank
waiting in a collective, a deadlocked lock, a rollout server that stopped answering) shows nowhere:
not in Jaeger, not in any tracker.  Every run (the driver's and each worker process's) holds its
open spans (``Run.open_spans``); one background thread per process looks at them about once a
second.  It runs while the main thread is blocked in native code (such waits release the GIL) and
while it spins in Python (the GIL is handed over every few milliseconds).

**The bound** of a phase, in seconds: ``OTEL_TRACKING_STALL_AFTER`` for every phase when set (``0``
turns reports off); else learned from the process itself: ``LEARNED_FACTOR`` (40) times the slowest
span of that name that has ended here, and never less than ``OTEL_TRACKING_STALL_FLOOR`` (300 s,
also the bound of a phase never seen to end).  A phase that varies 30x from step to step stays
under it.

**The report** (``stall_report.py`` says what is in it), one per *phase*, however many of its
spans (lanes) are stuck: once its oldest open span has been open for the bound, and again each
time that doubles while spans of it stay open past the bound.  An OTel log record (event name
``ml.stall``, severity WARN, in the oldest stuck span's trace), where the run's log records go
(OTLP, the file sink's events file, the trackers), and one line to stderr (``Run._report_stall``).

**Waiting for ranks to start is not a stall.**  When ranks the phase waits for have not started
yet (a worker group's actors still importing: ``Waiting.starting``), the phase is not stuck: a
stderr line says so when that is found and each time the wait doubles, no record is sent, the phase
is looked at again every second, and its bound counts from when the ranks were last seen starting.

**Nothing here waits without a bound**: whom a phase waits for is asked on a thread of its own with
a deadline (``stall_report._Lookup``); a child forked while the watcher holds its lock gets a fresh
one (``os.register_at_fork``).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from otel_tracking.runtime.stall_report import Stall, make_stall

LEARNED_FACTOR = 40.0
_POLL_S = 1.0  # how often the watcher looks, at most; more often for bounds under 4 s
_MIN_POLL_S = 0.05


class StallWatch:
    """One run's phases: how long each name has taken when it ended, and which phase is due a
    report when.  ``report`` is called from the watcher thread with each :class:`Stall`;
    ``starting`` (when given) with a phase that waits only for ranks to start (no stall)."""

    def __init__(
        self,
        after_s: float | None,
        floor_s: float,
        report: Callable[[Stall], None],
        starting: Callable[[Stall], None] | None = None,
    ) -> None:
        """``after_s``: one bound for every phase (None: learned; see the module's notes)."""
        self.after_s = after_s
        self.floor_s = floor_s
        self.report = report
        self.starting = starting
        self._slowest: dict[str, float] = {}
        self._due: dict[str, tuple[float, int]] = {}  # phase -> (open seconds of the next report, its number)
        # phase -> (open seconds when its ranks were last seen not started, of the next note saying so)
        self._starting: dict[str, tuple[float, float]] = {}

    def ended(self, name: str, seconds: float) -> None:
        if seconds > self._slowest.get(name, 0.0):
            self._slowest[name] = seconds

    def bound_s(self, name: str) -> float:
        if self.after_s is not None:
            return self.after_s
        return max(self.floor_s, LEARNED_FACTOR * self._slowest.get(name, 0.0))

    def smallest_bound_s(self) -> float:
        if self.after_s is not None:
            return self.after_s
        return self.floor_s

    def open_phases(self, open_spans: Mapping[Any, int], now_ns: int) -> dict[str, tuple[float, float]]:
        """Each phase with a span open: (how long its oldest open span has been open, its bound),
        in seconds: the gauges ``ml.phase.open`` and ``ml.phase.stall_bound``."""
        oldest: dict[str, float] = {}
        for span in list(open_spans):
            start = getattr(span, "start_time", None)
            if start is not None and span.is_recording():
                oldest[span.name] = max(oldest.get(span.name, 0.0), (now_ns - start) / 1e9)
        return {name: (open_s, self.bound_s(name)) for name, open_s in oldest.items()}

    def check(self, open_spans: Mapping[Any, int], now_ns: int | None = None) -> list[Stall]:
        """Report each phase whose oldest open span is past its next report time; returns the
        reports made (and the phases found waiting for ranks to start)."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        phases: dict[str, list[tuple[float, Any, int | None]]] = {}
        for span, thread_id in list(open_spans.items()):
            start = getattr(span, "start_time", None)
            if start is None or not span.is_recording():
                continue
            phases.setdefault(span.name, []).append(((now_ns - start) / 1e9, span, thread_id))
        reported: list[Stall] = []
        for name, spans in phases.items():
            bound = self.bound_s(name)
            stuck = sorted((s for s in spans if s[0] >= bound), key=lambda s: -s[0])
            if not stuck:  # none past the bound (any more): the next stall of it is a new one
                self._due.pop(name, None)
                continue
            due, number = self._due.get(name, (bound, 1))
            open_s = stuck[0][0]
            if open_s < due:
                continue
            stall = make_stall(name, stuck, bound, number)
            reported.append(stall)
            if stall.waiting.only_starting:
                # Not stuck: ranks it waits for have not begun. Looked at again soon (when they
                # start, its clock starts); said at once, then each time the wait doubles.
                _, note_due = self._starting.get(name, (open_s, open_s))
                if open_s >= note_due:
                    note_due = open_s * 2
                    if self.starting is not None:
                        self.starting(stall)
                self._starting[name] = (open_s, note_due)
                self._due[name] = (open_s + min(bound, _POLL_S), number)
                continue
            started = self._starting.get(name)
            if started is not None and open_s < started[0] + bound:
                self._due[name] = (started[0] + bound, number)  # a bound from when they were last seen starting
                continue
            self._due[name] = (max(due * 2, open_s * 1.5), number + 1)
            self.report(stall)
        for name in [n for n in self._due if n not in phases]:
            del self._due[name]
        for name in [n for n in self._starting if n not in self._due]:
            del self._starting[name]
        return reported


# --- the watcher thread: one per process --------------------------------------------------------

_Check = Callable[[], float]  # checks one run; returns the smallest bound it watches for


class _Watcher:
    def __init__(self) -> None:
        self.checks: weakref.WeakKeyDictionary[Any, _Check] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.pid: int | None = None
        self._pause = threading.Event()  # never set: its wait is the loop's pause

    def forget_in_child(self) -> None:
        """After ``fork()``, in the child: the parent's thread is not there, and its lock may have
        been held by that thread at the fork (then no one would ever release it: the child's first
        ``trace_state`` would wait for ever).  A fresh lock, no thread, no runs to check."""
        self.lock = threading.Lock()
        self.checks = weakref.WeakKeyDictionary()
        self.thread, self.pid = None, None
        self._pause = threading.Event()

    def watch(self, owner: Any, check: _Check) -> None:
        with self.lock:
            if self.pid != os.getpid():  # a forked child: its parent's thread is not here
                self.checks = weakref.WeakKeyDictionary()
                self.thread, self.pid = None, os.getpid()
            self.checks[owner] = check
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="otel-tracking-stall-watch", daemon=True)
                self.thread.start()

    def unwatch(self, owner: Any) -> None:
        with self.lock:
            self.checks.pop(owner, None)

    def _loop(self) -> None:
        while True:
            with self.lock:
                checks = list(self.checks.values())
            smallest = _POLL_S * 4
            for check in checks:
                try:
                    smallest = min(smallest, check())
                except Exception:  # a report that failed: the next look tries again
                    import logging

                    logging.getLogger("otel_tracking").debug("stall check failed", exc_info=True)
            # An Event's wait, not time.sleep: an application (or a test) that patches
            # time.sleep must not find this thread in its calls, or spinning.
            self._pause.wait(min(_POLL_S, max(_MIN_POLL_S, smallest / 4)))


_watcher = _Watcher()


os.register_at_fork(after_in_child=_watcher.forget_in_child)


def watch(owner: Any, check: _Check) -> None:
    """Call ``check`` about once a second (more often for bounds under 4 s) while ``owner`` lives
    and until :func:`unwatch`."""
    _watcher.watch(owner, check)


def unwatch(owner: Any) -> None:
    _watcher.unwatch(owner)
