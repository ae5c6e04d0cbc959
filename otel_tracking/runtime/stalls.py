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

**The report**, once the phase has been open for its bound and again each time that doubles while
it stays open: an OTel log record (event name ``ml.stall``, severity WARN, in the span's trace),
attributes ``ml.phase``, ``ml.step``, ``ml.lane``, ``ml.stall.open_s``, ``ml.stall.bound_s``,
``ml.stall.report`` (1, 2, ...), ``ml.stall.frame`` (the innermost line, outside the standard
library and this package, of the thread that opened the phase), ``thread.id`` and
``thread.name``; the run's resource says rank, role, host, pid and run.  Its body is the Python
stack of every thread of the process, that thread's first, scrubbed on the way out like every
record, and cut at ``MAX_STACKS_CHARS``.  It goes where the run's log
records go (OTLP, the file sink's events file, the trackers) and one line goes to stderr.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_tracking.signals import semconv

LEARNED_FACTOR = 40.0
MAX_STACKS_CHARS = 32_000
FRAMES_PER_THREAD = 30
_POLL_S = 1.0  # how often the watcher looks, at most; more often for bounds under 4 s
_MIN_POLL_S = 0.05


@dataclass(frozen=True)
class Stall:
    """One report: a phase open past its bound."""

    span: Any  # the open SDK span
    phase: str
    step: int | None
    lane: str | None
    open_s: float
    bound_s: float
    report: int  # 1 for the first report of this span, 2 for the next, ...
    thread_id: int | None
    thread_name: str | None
    frame: str | None  # "path:line in function" of the thread that opened the phase (_own_line)
    stacks: str
    waiting: Mapping[str, Any] = field(default_factory=dict)  # ml.stall.waiting_ranks, ml.stall.done_ranks

    def attributes(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            semconv.PHASE: self.phase,
            "ml.stall.open_s": round(self.open_s, 3),
            "ml.stall.bound_s": round(self.bound_s, 3),
            "ml.stall.report": self.report,
        }
        if self.step is not None:
            found[semconv.STEP] = self.step
        if self.lane is not None:
            found[semconv.LANE] = self.lane
        if self.frame is not None:
            found["ml.stall.frame"] = self.frame
        if self.thread_id is not None:
            found["thread.id"] = self.thread_id
        if self.thread_name is not None:
            found["thread.name"] = self.thread_name
        found.update(self.waiting)
        return found


class StallWatch:
    """One run's phases: how long each name has taken when it ended, and which open span is due a
    report when.  ``report`` is called from the watcher thread with each :class:`Stall`."""

    def __init__(self, after_s: float | None, floor_s: float, report: Callable[[Stall], None]) -> None:
        """``after_s``: one bound for every phase (None: learned; see the module's notes)."""
        self.after_s = after_s
        self.floor_s = floor_s
        self.report = report
        self._slowest: dict[str, float] = {}
        self._due: dict[int, tuple[float, int]] = {}  # span id -> (open seconds of the next report, its number)

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
        """Report each open span past its next report time; returns what was reported."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        reported: list[Stall] = []
        still_open: set[int] = set()
        for span, thread_id in list(open_spans.items()):
            start = getattr(span, "start_time", None)
            context = span.get_span_context()
            if start is None or not span.is_recording():
                continue
            key = context.span_id
            still_open.add(key)
            open_s = (now_ns - start) / 1e9
            bound = self.bound_s(span.name)
            due, number = self._due.get(key, (bound, 1))
            if open_s < due:
                continue
            self._due[key] = (max(due * 2, open_s * 1.5), number + 1)
            stall = _stall(span, open_s, bound, number, thread_id)
            reported.append(stall)
            self.report(stall)
        for key in [k for k in self._due if k not in still_open]:
            del self._due[key]
        return reported


# What a stuck span waits for, from whoever knows (the verl integration: the worker-group calls
# dispatched under it, verl/waiting.py): span -> (attributes, lines for the report's body), or None.
WaitingFor = Callable[[Any], "tuple[dict[str, Any], list[str]] | None"]
_waiting_sources: list[WaitingFor] = []


def add_waiting_source(source: WaitingFor) -> None:
    if source not in _waiting_sources:
        _waiting_sources.append(source)


def _waiting_for(span: Any) -> tuple[dict[str, Any], list[str]]:
    attributes: dict[str, Any] = {}
    lines: list[str] = []
    for source in list(_waiting_sources):
        try:
            found = source(span)
        except Exception:  # what it waits for is a detail: the report goes out without it
            found = None
        if found is not None:
            attributes.update(found[0])
            lines.extend(found[1])
    return attributes, lines


def _stall(span: Any, open_s: float, bound_s: float, number: int, thread_id: int | None) -> Stall:
    attributes = dict(getattr(span, "attributes", None) or {})
    step = attributes.get(semconv.STEP)
    lane = attributes.get(semconv.LANE)
    frames = sys._current_frames()
    frame = frames.get(thread_id) if thread_id is not None else None
    waiting, waiting_lines = _waiting_for(span)
    stacks = thread_stacks(frames, first=thread_id, phase=span.name)
    return Stall(
        span=span,
        phase=span.name,
        step=int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None,
        lane=None if lane is None else str(lane),
        open_s=open_s,
        bound_s=bound_s,
        report=number,
        thread_id=thread_id,
        thread_name=_thread_name(thread_id),
        frame=_own_line(frame),
        stacks="\n".join([*waiting_lines, "", stacks]) if waiting_lines else stacks,
        waiting=waiting,
    )


def stall_line(stall: Stall, resource: Mapping[str, Any]) -> str:
    """The one line a person reads first: who, which phase, how long, where."""
    role = resource.get(semconv.ROLE)
    rank = resource.get(semconv.RANK)
    who = " ".join(str(part) for part in (role, None if rank is None else f"rank {rank}") if part is not None)
    where = f"{who or 'process'} (pid {resource.get('process.pid')} on {resource.get('host.name')})"
    step = "" if stall.step is None else f" at step {stall.step}"
    lane = "" if stall.lane is None else f" lane {stall.lane}"
    said = f"stall: {where}: phase {stall.phase!r}{lane}{step} open {stall.open_s:.0f} s (bound {stall.bound_s:g} s)"
    if stall.frame:
        said += f", in {stall.frame}"
    waiting = stall.waiting.get("ml.stall.waiting_ranks")
    if waiting:
        said += f"; waiting for rank(s) {', '.join(map(str, waiting))}"
    return said


_PATHS = sysconfig.get_paths()
_NOT_OWN = (_PATHS["stdlib"], _PATHS["platstdlib"], os.path.dirname(os.path.dirname(__file__)), "<frozen ")


def _own_line(frame: Any) -> str | None:
    """The innermost line of the stack that is not the standard library's or ours (``wait`` in
    ``threading.py`` says little; the line that called it does), else the innermost line."""
    first = frame
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_NOT_OWN):
            break
        frame = frame.f_back
    frame = frame or first
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _thread_name(thread_id: int | None) -> str | None:
    for thread in threading.enumerate():
        if thread.ident == thread_id:
            return thread.name
    return None


def thread_stacks(frames: Mapping[int, Any], first: int | None = None, phase: str = "") -> str:
    """Every thread's Python stack, innermost call last (as ``py-spy dump`` shows them, and as a
    traceback reads), the thread ``first`` at the top; the watcher's own thread left out."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    order = sorted((ident for ident in frames if ident != me), key=lambda ident: (ident != first, ident))
    parts = []
    for ident in order:
        title = f'Thread {ident} "{names.get(ident, "?")}"'
        if ident == first:
            title += f" (opened {phase!r}; stuck here)"
        stack = "".join(traceback.format_stack(frames[ident], limit=FRAMES_PER_THREAD))
        parts.append(f"{title}:\n{stack}")
    text = "\n".join(parts)
    if len(text) > MAX_STACKS_CHARS:
        text = text[:MAX_STACKS_CHARS] + f"\n... ({len(text) - MAX_STACKS_CHARS} more characters cut)"
    return text


# --- the watcher thread: one per process --------------------------------------------------------

_Check = Callable[[], float]  # checks one run; returns the smallest bound it watches for


class _Watcher:
    def __init__(self) -> None:
        self.checks: weakref.WeakKeyDictionary[Any, _Check] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.pid: int | None = None
        self._pause = threading.Event()  # never set: its wait is the loop's pause

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


def watch(owner: Any, check: _Check) -> None:
    """Call ``check`` about once a second (more often for bounds under 4 s) while ``owner`` lives
    and until :func:`unwatch`."""
    _watcher.watch(owner, check)


def unwatch(owner: Any) -> None:
    _watcher.unwatch(owner)
