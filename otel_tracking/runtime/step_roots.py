"""The driver's step roots: one trace per step, and a root that encloses its children.

A phase that starts outside any span hangs under the root of the step in progress (``ml.step``,
opened on first use, started where the previous step's ``log()`` was).  ``log(step=N)`` *closes*
the root (it now says N) but does not end it yet:

- a span still open under it keeps it open: it ends once its last span has ended (a ``log()``
  inside ``trace_state("validate")`` no longer ends the root before ``validate``);
- a span that starts after the ``log()`` and says ``step=N`` (``trace_state("validate",
  step=N)``, after the step's metrics were logged) joins it: still one trace for step N;
- a span labelled with another step that starts outside a span belongs to that step: the closed
  root *retires* (it ends at once, or when its last span ends) and a new root opens;
- a span without ``step=`` that starts outside a span cannot know whether step N will be logged
  again (``log(train, N)``, ``trace_state("validate")``, ``log(val, N)``) or step N + 1 is
  beginning: it opens a *tentative* root, and the closed root waits.  The next ``log()`` decides:
  at N + 1 (the common case) the closed root retires and the tentative one is the new step's
  root; at N again the tentative root is merged into step N's: ``held_spans.py`` held its ended
  spans back from the sinks and now hands them on in step N's trace, under step N's root, saying
  step N, and step N's root is closed again, its end after theirs.  One trace, one root, one
  anatomy (``anatomy.py``) for the step.

A root's end time is its last ``log()`` or its last span's end, whichever is later, so its
duration is the step's, however late it is ended; it reaches the sinks when it ends: when the
next step's first phase starts (a phase with no ``step=``: at the ``log()`` that decides), at
``flush()`` or at ``finish()``.  A tentative root's spans reach the sinks at that ``log()``, not as
each ends.

A tentative root is an ordinary one, and its spans go out as they are, if the decision cannot
wait: at ``flush()`` (and SIGTERM), ``finish()``, a stall report, past ``held_spans.MAX_HELD``
spans, and when a carrier is taken in its trace (``propagation.inject()``, verl's worker calls:
another process's spans keep the trace id they were given).  If the next ``log()`` then says N
again, that root says N too and links to the step's first root (marked ``ml.step.continues``):
the step's two roots are measured as one step (``anatomy.py``), timed at the step
(``exporters/timings.py``) and drawn as one (the timeline), though the phases under the second
root say the next step (the step in progress when they began).  ``step=N`` on the span keeps it
in the step's one trace whatever happens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer

from otel_tracking.runtime.anatomy import StepTrace
from otel_tracking.runtime.held_spans import HeldSpans, Rehome
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
    stamped_step: int | None = None  # the step in progress it was opened at (its phases say it)
    # Tentative: opened by a phase without step= after the log() that closed this root, whose
    # step the next log() may say again (then this root is merged into it)
    awaits: StepRoot | None = None
    merged_into: StepRoot | None = None
    merged: list[StepRoot] = field(default_factory=list)  # the tentative roots merged into this one

    @property
    def trace_id(self) -> int:
        return self.span.get_span_context().trace_id

    def traces(self, end_ns: int) -> list[StepTrace]:
        """Its trace, and the traces merged into it: their phases were told by their own ids."""
        own = StepTrace(self.trace_id, self.start_ns, end_ns, self.first)
        return [own, *(StepTrace(m.trace_id, m.start_ns, end_ns) for m in self.merged)]


# Told of each root as it ends: its step (None: never logged) and its trace
RootEnded = Callable[["int | None", StepTrace], None]


class StepRoots:
    def __init__(
        self, tracer: Tracer, started_ns: int, on_ended: RootEnded | None = None, held: HeldSpans | None = None
    ) -> None:
        """``held``: the span processor that holds a tentative root's spans (``held_spans.py``);
        without it a step logged again keeps its second root (linked to the first)."""
        self._tracer = tracer
        self._held = held
        self._to_send: list[Any] = []  # what held_spans.py let go under the lock, handed on outside it
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
            awaited = None
            if root is not None and root.closed_ns is not None and said_step != root.step:
                if said_step is None and self._held is not None:
                    awaited, self._current = root, None  # the step logged again, or the next: log() says
                else:
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
                root.stamped_step, root.awaits = step_in_progress, awaited
                self._by_trace[root.trace_id] = root
                if awaited is not None and self._held is not None:
                    self._held.hold(root.trace_id)
        self._after_lock()
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
            while root.merged_into is not None:
                root = root.merged_into
            root.open_children -= 1
            root.last_end_ns = max(root.last_end_ns, end_ns)
            if root.retiring and root.open_children <= 0:
                self._end(root)
        self._after_lock()

    def step_logged(self, step: int, now_ns: int) -> None:
        """``log(step=step)`` at ``now_ns`` closes the step in progress (or, at the same step
        again, moves its end)."""
        with self._lock:
            self._next_start_ns = now_ns
            self._logged_once = True
            root = self._current
            if root is not None and root.awaits is not None and self._merge(root, step, now_ns):
                pass  # the same step again: its phases since the first log() are in its trace now
            elif root is not None and root.closed_ns is not None and root.step != step:
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
        self._after_lock()

    def _merge(self, tentative: StepRoot, step: int, now_ns: int) -> bool:
        """The next ``log()`` after a tentative root opened says ``step``: if that is the awaited
        root's step again, the tentative root's spans go into its trace (``held_spans.py``) and it
        is the step's one root again, closed now; True then.  Otherwise the awaited root ends and
        the tentative one is an ordinary root (False)."""
        earlier, tentative.awaits = tentative.awaits, None
        assert earlier is not None and self._held is not None
        if earlier.step == step:
            rehome = Rehome(
                trace_id=earlier.trace_id,
                root_span_id=earlier.span.get_span_context().span_id,
                tentative_root_span_id=tentative.span.get_span_context().span_id,
                stamped_step=tentative.stamped_step,
                step=step,
            )
            spans = self._held.decide(tentative.trace_id, rehome)
            if spans is not None:
                self._to_send.append(spans)
                earlier.open_children += tentative.open_children
                earlier.last_end_ns = max(earlier.last_end_ns, tentative.last_end_ns)
                earlier.closed_ns = now_ns
                tentative.merged_into = earlier
                earlier.merged.append(tentative)
                self._by_trace[tentative.trace_id] = earlier  # its spans still open count for the step
                self._current = self._last_closed = earlier
                return True
        self._let_go(tentative, earlier)
        return False

    def _let_go(self, tentative: StepRoot, earlier: StepRoot) -> None:
        """Undecided no more: the awaited root ends (or once its last span ends), the tentative
        root's spans go out as they are."""
        tentative.awaits = None
        self._retire(earlier)
        if self._held is not None:
            self._to_send.append(self._held.decide(tentative.trace_id, None) or [])

    def stop_holding(self) -> None:
        """A tentative root's spans go out as they are now (``flush()``, ``finish()``, a stall
        report): if its step is logged again, its root stays a second one, linked to the first."""
        with self._lock:
            root = self._current
            if root is not None and root.awaits is not None:
                self._let_go(root, root.awaits)
        self._after_lock()

    def carrier_taken(self, trace_id: int) -> int | None:
        """A carrier is taken in trace ``trace_id``: if it is a tentative root's, that trace keeps
        its id (another process's spans cannot be moved), so its spans are held no more.  If it
        was merged into a step's trace already (a phase still open then), the id the carrier must
        name instead."""
        root = self._current
        if root is not None and root.awaits is not None and root.trace_id == trace_id:
            self.stop_holding()
            return None
        return self._held.moved_to(trace_id) if self._held is not None else None

    def unended_before(self, step: int) -> list[tuple[int, StepTrace]]:
        """``log(step=step)``: the roots of other steps that have not ended yet (a span of theirs is
        still open), each with its step and its trace up to its last ``log()`` or ended span; they
        are measured now, before ``step``'s values (what is still open counts for no step), and
        not told again when they end."""
        found = []
        with self._lock:
            for root in self._roots():
                if root.step is not None and root.step != step and root.closed_ns is not None and not root.told:
                    root.told = True
                    found += [(root.step, trace) for trace in root.traces(max(root.closed_ns, root.last_end_ns))]
        return found

    def retire_closed(self) -> None:
        """``flush()``: a closed step's root ends now (or once its last span ends) instead of at
        the next step's first phase: what is done is delivered.  A span saying its step that
        starts afterwards begins a trace of its own."""
        self.stop_holding()
        with self._lock:
            if self._current is not None and self._current.closed_ns is not None:
                self._retire(self._current)
        self._after_lock()

    def end_all(self, now_ns: int, **attributes: Any) -> None:
        """``finish()``: every root ends now (the spans still open were ended just before)."""
        self.stop_holding()
        with self._lock:
            for root in self._roots():
                if root.closed_ns is None:
                    root.span.set_attributes(attributes)
                    root.closed_ns = now_ns
                self._end(root)
            self._current = None
        self._after_lock()

    def _roots(self) -> list[StepRoot]:
        """Every root not ended yet, once each (a merged trace's id names the root it went into)."""
        return list({id(root): root for root in self._by_trace.values()}.values())

    def _retire(self, root: StepRoot) -> None:
        root.retiring = True
        if self._current is root:
            self._current = None
        if root.open_children <= 0:
            self._end(root)

    def _end(self, root: StepRoot) -> None:
        if self._by_trace.pop(root.trace_id, None) is None:
            return  # ended already
        for merged in root.merged:
            self._by_trace.pop(merged.trace_id, None)
        assert root.closed_ns is not None
        end_ns = max(root.closed_ns, root.last_end_ns)
        root.span.end(end_time=end_ns)
        if self._on_ended is not None and not root.told:
            self._ended += [(root.step, trace) for trace in root.traces(end_ns)]

    def _after_lock(self) -> None:
        """Hand on the spans let go, and tell ``on_ended`` of the roots that ended, outside the
        lock (a sink's hand-over takes time; ``on_ended`` may log at their step)."""
        if not self._to_send and not (self._ended and self._on_ended is not None):
            return
        with self._lock:
            to_send, self._to_send = self._to_send, []
            ended, self._ended = self._ended, []
        if self._held is not None:
            for spans in to_send:
                self._held.send(spans)
        if self._on_ended is not None:
            for args in ended:
                self._on_ended(*args)
