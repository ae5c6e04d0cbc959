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

**The report**, one per *phase* (however many of its spans, lanes, are stuck): once its oldest
open span has been open for the bound, and again each time that doubles while spans of it stay
open past the bound.  An OTel log record (event name ``ml.stall``, severity WARN, in the oldest
stuck span's trace), attributes ``ml.phase``, ``ml.step``, ``ml.lane``, ``ml.stall.open_s``,
``ml.stall.bound_s``, ``ml.stall.report`` (1, 2, ...), ``ml.stall.spans`` (how many spans of the
phase are past the bound) and ``ml.stall.lanes`` (their lanes, at most ``MAX_LISTED``),
``ml.stall.frame`` (the innermost line, outside the standard library and this package, of the
thread that opened the oldest span), ``thread.id`` and ``thread.name``; the run's resource says
rank, role, host, pid and run.  Its body is the Python stack of every thread of the process, that
thread's first, after what the phase waits for (``WaitingFor`` sources); the whole body is cut at
``MAX_BODY_CHARS``, and every list and text attribute has a bound, so a record's size does not
grow with the number of lanes or ranks.  It goes where the run's log records go (OTLP, the file
sink's events file, the trackers) and one line goes to stderr.

**Scrubbed where it leaves**: the phase, lanes, thread name and frame are user input (a phase named
after the URL it downloads); they are scrubbed here (``signals/redact.py``) before any line, record,
alert title or file name is made of them.

**Nothing here waits without a bound.**  What a phase waits for is asked on a thread of its own
(``otel-tracking-stall-lookup``), for at most ``LOOKUP_TIMEOUT_S``; a source that does not answer
(a Ray GCS that hangs) costs that report its waiting lines, which then say so, and no later report
waits for it again while it still hangs.

**Waiting for ranks to start is not a stall.**  When every call the phase waits for is held up
by ranks whose process has not started yet (a worker group's actors still importing), the phase is
not stuck: one stderr line says ``waiting for N ranks to start``, no record is sent, and the phase's
clock starts again, a bound from then.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_tracking.signals import semconv
from otel_tracking.signals.redact import scrub_text

LEARNED_FACTOR = 40.0
MAX_BODY_CHARS = 32_000  # a record's body: waiting lines and stacks together
MAX_LISTED = 64  # lanes or ranks named one by one in a record; the rest are counted
MAX_TEXT = 500  # characters of any one text attribute (a phase, lane, frame or thread name)
FRAMES_PER_THREAD = 30
LOOKUP_TIMEOUT_S = 2.0  # how long a report waits to learn whom its phase waits for
_POLL_S = 1.0  # how often the watcher looks, at most; more often for bounds under 4 s
_MIN_POLL_S = 0.05


def safe_text(value: Any, limit: int = MAX_TEXT) -> str:
    """User input made fit to leave the process: credentials scrubbed, then cut at ``limit``."""
    text = scrub_text(str(value))
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


@dataclass(frozen=True)
class Waiting:
    """Whom a stuck phase waits for (the verl integration: its worker-group calls' ranks)."""

    waiting: tuple[int, ...] = ()  # ranks whose call has not returned
    done: tuple[int, ...] = ()  # ranks whose call has
    starting: tuple[int, ...] = ()  # of ``waiting``: ranks whose process has not started yet
    lines: tuple[str, ...] = ()  # for the report's body (a line per waiting rank, at most MAX_LISTED)
    unknown: str | None = None  # why it could not be learned, when it could not

    @property
    def only_starting(self) -> bool:
        """Some ranks it waits for have not started: the phase waits for them, it is not stuck."""
        return bool(self.starting) and self.unknown is None

    def attributes(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        if self.waiting or self.done:
            found["ml.stall.waiting_ranks"] = list(self.waiting[:MAX_LISTED])
            found["ml.stall.done_ranks"] = list(self.done[:MAX_LISTED])
            found["ml.stall.waiting_count"] = len(self.waiting)
            found["ml.stall.done_count"] = len(self.done)
        if self.starting:
            found["ml.stall.starting_count"] = len(self.starting)
        if self.unknown is not None:
            found["ml.stall.waiting_unknown"] = safe_text(self.unknown)
        return found


def merged(found: Iterable[Waiting]) -> Waiting:
    found = list(found)
    if len(found) == 1:
        return found[0]
    unknown = [w.unknown for w in found if w.unknown is not None]
    return Waiting(
        waiting=tuple(sorted({r for w in found for r in w.waiting})),
        done=tuple(sorted({r for w in found for r in w.done})),
        starting=tuple(sorted({r for w in found for r in w.starting})),
        lines=tuple(line for w in found for line in w.lines),
        unknown="; ".join(unknown) if unknown else None,
    )


def ranks_text(ranks: Sequence[int], total: int | None = None) -> str:
    """``0, 1, 2`` for a few ranks; the first ``MAX_LISTED`` and a count for many."""
    total = len(ranks) if total is None else total
    shown = ", ".join(map(str, ranks[:MAX_LISTED]))
    return shown if total <= MAX_LISTED else f"{shown}, ... ({total} in all)"


@dataclass(frozen=True)
class Stall:
    """One report: a phase open past its bound (its oldest stuck span, and how many are stuck)."""

    span: Any  # the oldest stuck SDK span of the phase
    phase: str
    step: int | None
    lane: str | None
    open_s: float
    bound_s: float
    report: int  # 1 for the first report of this phase's stall, 2 for the next, ...
    thread_id: int | None
    thread_name: str | None
    frame: str | None  # "path:line in function" of the thread that opened the span (_own_line)
    stacks: str  # the record's body: what it waits for, then every thread's stack (MAX_BODY_CHARS)
    waiting: Waiting = field(default_factory=Waiting)
    spans: int = 1  # spans of the phase open past its bound
    lanes: tuple[str, ...] = ()  # their lanes (at most MAX_LISTED), when there is more than one

    def attributes(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            semconv.PHASE: self.phase,
            "ml.stall.open_s": round(self.open_s, 3),
            "ml.stall.bound_s": round(self.bound_s, 3),
            "ml.stall.report": self.report,
            "ml.stall.spans": self.spans,
        }
        if self.step is not None:
            found[semconv.STEP] = self.step
        if self.lane is not None:
            found[semconv.LANE] = self.lane
        if self.lanes:
            found["ml.stall.lanes"] = list(self.lanes)
        if self.frame is not None:
            found["ml.stall.frame"] = self.frame
        if self.thread_id is not None:
            found["thread.id"] = self.thread_id
        if self.thread_name is not None:
            found["thread.name"] = self.thread_name
        found.update(self.waiting.attributes())
        return found


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
            stall = _stall(name, stuck, bound, number)
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


# What a stuck span waits for, from whoever knows (the verl integration: the worker-group calls
# dispatched under it and under its open children, verl/waiting.py): span -> Waiting, or None.
WaitingFor = Callable[[Any], "Waiting | None"]
_waiting_sources: list[WaitingFor] = []


def add_waiting_source(source: WaitingFor) -> None:
    if source not in _waiting_sources:
        _waiting_sources.append(source)


def _ask_sources(span: Any) -> Waiting | None:
    found: list[Waiting] = []
    for source in list(_waiting_sources):
        try:
            answer = source(span)
        except Exception as error:  # what it waits for is a detail: the report goes out without it
            answer = Waiting(unknown=f"{type(error).__name__}: {error}")
        if answer is not None:
            found.append(answer)
    return merged(found) if found else None


class _Lookup:
    """Asks the waiting sources on a thread of its own, for at most ``LOOKUP_TIMEOUT_S``: a source
    that hangs costs one report its answer, never the watcher thread.  While an earlier lookup
    still hangs, no other starts (one stuck thread at most), and reports say so at once."""

    def __init__(self) -> None:
        self.hung: tuple[threading.Thread, float] | None = None  # the lookup that did not answer, since when

    def ask(self, span: Any, timeout_s: float) -> Waiting | None:
        if not _waiting_sources:
            return None
        if self.hung is not None:
            thread, since = self.hung
            if thread.is_alive():
                hung_s = time.monotonic() - since
                return Waiting(unknown=f"not known: an earlier lookup has not answered for {hung_s:.0f} s")
            self.hung = None
        answer: list[Waiting | None] = []
        done = threading.Event()

        def look() -> None:
            try:
                answer.append(_ask_sources(span))
            finally:
                done.set()

        thread = threading.Thread(target=look, name="otel-tracking-stall-lookup", daemon=True)
        thread.start()
        if done.wait(timeout_s):
            return answer[0] if answer else None
        self.hung = (thread, time.monotonic() - timeout_s)
        return Waiting(unknown=f"not known: the lookup did not answer within {timeout_s:g} s")


_lookup = _Lookup()


def _waiting_lines(waiting: Waiting) -> list[str]:
    lines: list[str] = []
    if waiting.unknown is not None:
        lines.append(f"Whom it waits for: {waiting.unknown}")
    if waiting.waiting or waiting.done:
        lines.append(
            f"Waiting for {len(waiting.waiting)} rank(s): {ranks_text(waiting.waiting)}; "
            f"returned: {len(waiting.done)} rank(s): {ranks_text(waiting.done)}"
        )
    if waiting.starting:
        lines.append(f"Of those, {len(waiting.starting)} not started yet: {ranks_text(waiting.starting)}")
    lines.extend(waiting.lines[:MAX_LISTED])
    if len(waiting.lines) > MAX_LISTED:
        lines.append(f"  ... {len(waiting.lines) - MAX_LISTED} more")
    return lines


def _stall(phase: str, stuck: list[tuple[float, Any, int | None]], bound_s: float, number: int) -> Stall:
    """The report of a phase whose spans ``stuck`` (oldest first) are past its bound."""
    open_s, span, thread_id = stuck[0]
    attributes = dict(getattr(span, "attributes", None) or {})
    step = attributes.get(semconv.STEP)
    lane = attributes.get(semconv.LANE)
    lanes = sorted({safe_text(a, 100) for a in (_lane_of(s) for _, s, _ in stuck) if a is not None})
    frames = sys._current_frames()
    frame = frames.get(thread_id) if thread_id is not None else None
    waiting = _lookup.ask(span, LOOKUP_TIMEOUT_S) or Waiting()
    waiting_lines = _waiting_lines(waiting)
    safe_phase = safe_text(phase)
    body = thread_stacks(frames, first=thread_id, phase=safe_phase)
    if waiting_lines:
        body = "\n".join([*waiting_lines, "", body])
    if len(stuck) > 1:
        listed = ", ".join(lanes[:MAX_LISTED]) + (f", ... ({len(lanes)} in all)" if len(lanes) > MAX_LISTED else "")
        body = f"{len(stuck)} spans of {safe_phase!r} open past {bound_s:g} s, on lanes: {listed or '-'}\n\n{body}"
    own = _own_line(frame)
    thread_name = _thread_name(thread_id)
    return Stall(
        span=span,
        phase=safe_phase,
        step=int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None,
        lane=None if lane is None else safe_text(lane),
        open_s=open_s,
        bound_s=bound_s,
        report=number,
        thread_id=thread_id,
        thread_name=None if thread_name is None else safe_text(thread_name),
        frame=None if own is None else safe_text(own, 2 * MAX_TEXT),
        stacks=cut(body, MAX_BODY_CHARS),
        waiting=waiting,
        spans=len(stuck),
        lanes=tuple(lanes[:MAX_LISTED]) if len(lanes) > 1 else (),
    )


def _lane_of(span: Any) -> Any:
    return (getattr(span, "attributes", None) or {}).get(semconv.LANE)


def cut(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters long, saying how much was cut."""
    if len(text) <= limit:
        return text
    note = f"\n... ({len(text) - limit} more characters cut)"
    return text[: max(0, limit - len(note))] + note


def stall_line(stall: Stall, resource: Mapping[str, Any]) -> str:
    """The one line a person reads first: who, which phase, how long, where.  Scrubbed whole:
    every part of it may carry user input."""
    said = f"stall: {_who(resource)}: {_what(stall)} open {stall.open_s:.0f} s (bound {stall.bound_s:g} s)"
    if stall.frame:
        said += f", in {stall.frame}"
    waiting = stall.waiting
    if waiting.waiting:
        said += f"; waiting for rank(s) {ranks_text(waiting.waiting)}"
    elif waiting.unknown is not None:
        said += f"; whom it waits for: {waiting.unknown}"
    return scrub_text(said)


def starting_line(stall: Stall, resource: Mapping[str, Any]) -> str:
    """A phase that waits for ranks to start: said, not reported as a stall."""
    count = len(stall.waiting.starting)
    said = (
        f"{_who(resource)}: {_what(stall)} open {stall.open_s:.0f} s: waiting for {count} rank(s) to start "
        f"({ranks_text(stall.waiting.starting)}); not a stall"
    )
    return scrub_text(said)


def _who(resource: Mapping[str, Any]) -> str:
    role = resource.get(semconv.ROLE)
    rank = resource.get(semconv.RANK)
    who = " ".join(str(part) for part in (role, None if rank is None else f"rank {rank}") if part is not None)
    return f"{who or 'process'} (pid {resource.get('process.pid')} on {resource.get('host.name')})"


def _what(stall: Stall) -> str:
    step = "" if stall.step is None else f" at step {stall.step}"
    if stall.spans > 1:
        lanes = f" ({stall.spans} lanes)" if stall.lanes else f" ({stall.spans} spans)"
    else:
        lanes = "" if stall.lane is None else f" lane {stall.lane}"
    return f"phase {stall.phase!r}{lanes}{step}"


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
    return cut("\n".join(parts), MAX_BODY_CHARS)


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


def _forget_in_child() -> None:
    _watcher.forget_in_child()
    _lookup.hung = None  # that thread is the parent's


os.register_at_fork(after_in_child=_forget_in_child)


def watch(owner: Any, check: _Check) -> None:
    """Call ``check`` about once a second (more often for bounds under 4 s) while ``owner`` lives
    and until :func:`unwatch`."""
    _watcher.watch(owner, check)


def unwatch(owner: Any) -> None:
    _watcher.unwatch(owner)
