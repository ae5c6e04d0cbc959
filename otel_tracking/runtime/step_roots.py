"""The driver's step roots: one trace per step, and a root that encloses its children.

A phase that starts outside any span hangs under the root of the step in progress (``ml.step``,
opened on first use, started where the previous step's ``log()`` was).  ``log(step=N)`` *closes*
the root (it now says N) but does not end it yet:

- a span still open under it keeps it open: it ends once its last span has ended (a ``log()``
  inside ``trace_state("validate")`` no longer ends the root before ``validate``);
- a span that starts after the ``log()`` and says ``step=N`` (``trace_state("validate",
  step=N)``, after the step's metrics were logged) joins it: still one trace for step N;
- any other span that starts outside a span belongs to the next step: the closed root *retires*
  (it ends at once, or when its last span ends) and a new root opens.

A root's end time is its last ``log()`` or its last span's end, whichever is later, so its
duration is the step's, however late it is ended; it reaches the sinks when it ends, at the latest
when the next step's first phase starts, at ``flush()`` or at ``finish()``.

A span that starts after ``log(step=N)`` without ``step=`` cannot know whether step N will be
logged again (``log(train, N)``, ``trace_state("validate")``, ``log(val, N)``) or step N + 1 is
beginning, so it opens a new root; when the next ``log()`` says N again, that root says N too and
links to the step's first root (both marked ``ml.step.continues``): the step's two roots, whose
time spans follow each other, are measured as one step (``anatomy.py``), timed at the step
(``exporters/timings.py``) and drawn as one (the timeline), though the phases under the second
root say the next step (the step in progress when they began).  ``step=N`` on the span keeps it in
the step's one trace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer

from otel_tracking.runtime.anatomy import StepTrace
from otel_tracking.signals.semconv import CONTINUES, STEP, STEP_SPAN_NAME


@dataclass
class StepRoot:
    span: Span
    step: int | None = None  # said by the log() that closed it
    closed_ns: int | None = None  # the time of that log() (the latest one at this step)
    open_children: int = 0
    last_end_ns: int = 0
    retiring: bool = False  # the next step has begun: end as soon as no child is open
    start_ns: int = 0
    first: bool = False  # no log() before it: it started with the run
    told: bool = False  # its step was measured before it ended (see unended_before)

    def trace(self, end_ns: int) -> StepTrace:
        return StepTrace(self.span.get_span_context().trace_id, self.start_ns, end_ns, self.first)


# Told of each root as it ends: its step (None: never logged) and its trace
RootEnded = Callable[["int | None", StepTrace], None]


class StepRoots:
    def __init__(self, tracer: Tracer, started_ns: int, on_ended: RootEnded | None = None) -> None:
        self._tracer = tracer
        self._lock = threading.Lock()
        self._current: StepRoot | None = None
        self._by_trace: dict[int, StepRoot] = {}  # every root not ended yet, by its trace id
        self._next_start_ns = started_ns
        self._logged_once = False
        self._on_ended = on_ended
        self._ended: list[tuple[int | None, StepTrace]] = []  # told outside the lock
        self._last_closed: StepRoot | None = None  # the root the last log() closed

    def context_for(self, ctx: Context, step_in_progress: int | None, said_step: int | None) -> Context:
        """``ctx`` with the step root a span starting now, outside any span, hangs under;
        ``said_step`` is the span's own ``step=`` label, if it has one."""
        with self._lock:
            root = self._current
            if root is not None and root.closed_ns is not None and said_step != root.step:
                self._retire(root)
                root = None
            if root is None:
                attributes = {STEP: step_in_progress} if step_in_progress is not None else {}
                span = self._tracer.start_span(
                    STEP_SPAN_NAME,
                    context=Context(),  # a root: one trace per step
                    attributes=attributes,
                    start_time=self._next_start_ns,
                )
                root = self._current = StepRoot(span, start_ns=self._next_start_ns, first=not self._logged_once)
                self._by_trace[span.get_span_context().trace_id] = root
        self._tell_ended()
        return trace.set_span_in_context(root.span, ctx)

    def child_started(self, span: Span) -> StepRoot | None:
        """Count ``span`` (any span of this process) as open under its trace's root, if that root
        has not ended; the root to hand to :meth:`child_ended`."""
        with self._lock:
            root = self._by_trace.get(span.get_span_context().trace_id)
            if root is not None:
                root.open_children += 1
            return root

    def child_ended(self, root: StepRoot, end_ns: int) -> None:
        with self._lock:
            root.open_children -= 1
            root.last_end_ns = max(root.last_end_ns, end_ns)
            if root.retiring and root.open_children <= 0:
                self._end(root)
        self._tell_ended()

    def step_logged(self, step: int, now_ns: int) -> None:
        """``log(step=step)`` at ``now_ns`` closes the step in progress (or, at the same step
        again, moves its end)."""
        with self._lock:
            self._next_start_ns = now_ns
            self._logged_once = True
            root = self._current
            if root is not None and root.closed_ns is not None and root.step != step:
                self._retire(root)  # a step with no span of its own
            elif root is not None:
                earlier = self._last_closed
                if root.closed_ns is None and earlier is not None and earlier is not root and earlier.step == step:
                    # the same step again, after a phase that began a root of its own: say so
                    root.span.add_link(earlier.span.get_span_context(), {CONTINUES: True})
                    root.span.set_attribute(CONTINUES, True)
                root.step, root.closed_ns = step, now_ns
                root.span.set_attribute(STEP, step)
                self._last_closed = root
        self._tell_ended()

    def unended_before(self, step: int) -> list[tuple[int, StepTrace]]:
        """``log(step=step)``: the roots of other steps that have not ended yet (a span of theirs is
        still open), each with its step and its trace up to its last ``log()`` or ended span; they
        are measured now, before ``step``'s values (what is still open counts for no step), and
        not told again when they end."""
        found = []
        with self._lock:
            for root in self._by_trace.values():
                if root.step is not None and root.step != step and root.closed_ns is not None and not root.told:
                    root.told = True
                    found.append((root.step, root.trace(max(root.closed_ns, root.last_end_ns))))
        return found

    def retire_closed(self) -> None:
        """``flush()``: a closed step's root ends now (or once its last span ends) instead of at
        the next step's first phase: what is done is delivered.  A span saying its step that
        starts afterwards begins a trace of its own."""
        with self._lock:
            if self._current is not None and self._current.closed_ns is not None:
                self._retire(self._current)
        self._tell_ended()

    def end_all(self, now_ns: int, **attributes: Any) -> None:
        """``finish()``: every root ends now (the spans still open were ended just before)."""
        with self._lock:
            for root in list(self._by_trace.values()):
                if root.closed_ns is None:
                    root.span.set_attributes(attributes)
                    root.closed_ns = now_ns
                self._end(root)
            self._current = None
        self._tell_ended()

    def _retire(self, root: StepRoot) -> None:
        root.retiring = True
        if self._current is root:
            self._current = None
        if root.open_children <= 0:
            self._end(root)

    def _end(self, root: StepRoot) -> None:
        if self._by_trace.pop(root.span.get_span_context().trace_id, None) is None:
            return  # ended already
        assert root.closed_ns is not None
        end_ns = max(root.closed_ns, root.last_end_ns)
        root.span.end(end_time=end_ns)
        if self._on_ended is not None and not root.told:
            self._ended.append((root.step, root.trace(end_ns)))

    def _tell_ended(self) -> None:
        """Tell ``on_ended`` of the roots that ended, outside the lock (it may log at their step)."""
        if not self._ended or self._on_ended is None:
            return
        with self._lock:
            ended, self._ended = self._ended, []
        for args in ended:
            self._on_ended(*args)
