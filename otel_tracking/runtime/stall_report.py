"""What a stall report says (``stalls.py`` decides when one is due): the phase, its oldest stuck
span, how many of its spans are stuck and on which lanes, where the thread that opened it is, whom
it waits for, and every thread's stack.

As a record's attributes (:meth:`Stall.attributes`): ``ml.phase``, ``ml.step``, ``ml.lane``,
``ml.stall.open_s``, ``ml.stall.bound_s``, ``ml.stall.report`` (1, 2, ...), ``ml.stall.spans``
(spans of the phase past the bound), ``ml.stall.lanes`` (their lanes, when more than one),
``ml.stall.frame`` (the innermost line, outside the standard library and this package, of the
thread that opened the oldest span), ``thread.id``, ``thread.name``, and whom it waits for
(:meth:`Waiting.attributes`); the run's resource says rank, role, host, pid and run.  Its body:
whom it waits for, then the Python stack of every thread of the process, that thread's first.

**Scrubbed where it is made**: the phase, lanes, thread name and frame are user input (a phase
named after the URL it downloads); they are scrubbed (``signals/redact.py``) and cut at
``MAX_TEXT`` here, before any line, record, alert title or file name is made of them, and the
stderr lines are scrubbed whole.

**Bounded at any scale**: the body (what the phase waits for, then the stacks) is cut as a whole at
``MAX_BODY_CHARS``; lanes and ranks are named at most ``MAX_LISTED`` at a time, with their counts.

**Whom a phase waits for** comes from sources (``add_waiting_source``: the verl integration's
worker-group calls, ``verl/waiting.py``), asked on a thread of their own (``_Lookup``) for at most
``LOOKUP_TIMEOUT_S``: a source that hangs (a Ray GCS that does not answer) costs a report its
answer, which then says so, and never the watcher thread; while it still hangs no other lookup
starts.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_tracking.signals import semconv
from otel_tracking.signals.redact import scrub_text

MAX_BODY_CHARS = 32_000  # a record's body: waiting lines and stacks together
MAX_LISTED = 64  # lanes or ranks named one by one in a record; the rest are counted
MAX_TEXT = 500  # characters of any one text attribute (a phase, lane, frame or thread name)
FRAMES_PER_THREAD = 30
LOOKUP_TIMEOUT_S = 2.0  # how long a report waits to learn whom its phase waits for


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


def ranks_text(ranks: Sequence[int]) -> str:
    """``0, 1, 2`` for a few ranks; the first ``MAX_LISTED`` and a count for many."""
    shown = ", ".join(map(str, ranks[:MAX_LISTED]))
    return shown if len(ranks) <= MAX_LISTED else f"{shown}, ... ({len(ranks)} in all)"


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
            "ml.stall.open_s": self.open_s,
            "ml.stall.bound_s": self.bound_s,
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


def make_stall(phase: str, stuck: list[tuple[float, Any, int | None]], bound_s: float, number: int) -> Stall:
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
        # to the millisecond once, so the record and the line on stderr say the same number
        # (rounding 2.5004 to 2.5 for the record and to "3 s" for the line once told them apart)
        open_s=round(open_s, 3),
        bound_s=round(bound_s, 3),
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


def _forget_in_child() -> None:
    _lookup.hung = None  # that thread is the parent's


os.register_at_fork(after_in_child=_forget_in_child)
