"""The spans of a step that may yet be the previous one, held until the next ``log()`` says.

After ``log(step=N)`` a phase without ``step=`` opens a *tentative* root (``step_roots.py``): the
next ``log()`` says whether it began step N + 1 (the common case) or belongs to step N, logged
again (train values, ``validate``, the validation values).  :class:`HeldSpans`, a span processor
in front of the sinks, keeps the ended spans of such a trace (and, through :attr:`HeldSpans.logs`,
the log records emitted in it: validation generations) instead of handing them on; when the next
``log()`` decides, they go out as they are (N + 1), or *re-homed* into step N's trace: its trace
id, the tentative root's children hung under step N's root, their ``ml.step`` the step they
served.  Span ids do not change.  What ends in that trace later (a phase still open at the
decision) is re-homed as it ends.  The tentative root itself is never exported then.

What is held is bounded: past :data:`MAX_HELD` items the trace is let go as it is (and the step's
second root links to its first, as before), and ``step_roots.py`` lets it go at ``flush()``,
``finish()``, a stall report, and when a carrier is taken inside it: another process's spans
cannot be rewritten, so that trace must keep its own id.  A carrier taken in a re-homed trace
(inside a phase still open at the decision) names step N's trace instead (:meth:`moved_to`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import SpanContext

from otel_tracking.compat.otel_sdk import LogRecordProcessor, ReadWriteLogRecord
from otel_tracking.delivery.pipeline import SinkLogProcessor, SinkSpanProcessor
from otel_tracking.signals.semconv import STEP

MAX_HELD = 4096  # spans and records of one tentative trace; past this they go out as they are
REHOMED_KEPT = 64  # re-homed traces remembered for the spans still open at the decision


@dataclass(frozen=True)
class Rehome:
    """Where a tentative trace's spans go: step ``step``'s trace, under its root."""

    trace_id: int  # step N's
    root_span_id: int  # step N's root
    tentative_root_span_id: int  # the root it replaces (its children hang under step N's)
    stamped_step: int | None  # the step the tentative phases were stamped with (N + 1)
    step: int  # N


Held = ReadableSpan | ReadWriteLogRecord  # an ended span, or a log record emitted in the trace


class HeldSpans(SpanProcessor):
    """Hands ``inner`` each ended span, but those of a held trace (see the module docstring);
    :attr:`logs` does the same for the log records emitted in it (validation generations)."""

    def __init__(self, inner: SinkSpanProcessor, inner_logs: SinkLogProcessor) -> None:
        self._inner = inner
        self._inner_logs = inner_logs
        self.logs = _HeldLogs(self)
        """The log record processor in front of ``inner_logs``."""
        self._lock = threading.Lock()
        self._held: dict[int, list[Held]] = {}  # tentative trace id -> its ended spans and records
        self._rehomed: dict[int, Rehome] = {}

    def hold(self, trace_id: int) -> None:
        with self._lock:
            self._held.setdefault(trace_id, [])

    def decide(self, trace_id: int, rehome: Rehome | None = None) -> list[Held] | None:
        """Decide a held trace: what it held, to :meth:`send` (re-homed now if ``rehome`` is
        given; so is what ends in it later).  None if it was no longer held (let go past
        :data:`MAX_HELD`): then nothing is re-homed."""
        with self._lock:
            held = self._held.pop(trace_id, None)
            if held is None:
                return None
            if rehome is not None:
                self._rehomed[trace_id] = rehome
                while len(self._rehomed) > REHOMED_KEPT:
                    del self._rehomed[next(iter(self._rehomed))]
        return held if rehome is None else [_rehomed(item, rehome) for item in held]

    def moved_to(self, trace_id: int) -> int | None:
        """The trace a re-homed trace's spans go to (None: not re-homed)."""
        rehome = self._rehomed.get(trace_id) if self._rehomed else None
        return rehome.trace_id if rehome is not None else None

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        self._pass(span, span.context.trace_id if span.context is not None else 0)

    def _pass(self, item: Held, trace_id: int) -> None:
        """Hold ``item`` if its trace is held, else hand it on (re-homed if its trace was)."""
        if self._held or self._rehomed:  # (no lock taken before the first tentative root)
            too_many: list[Held] = []
            with self._lock:
                held = self._held.get(trace_id)
                if held is not None:
                    if len(held) < MAX_HELD:
                        held.append(item)
                        return
                    too_many = self._held.pop(trace_id)  # the trace goes out as it is
                rehome = self._rehomed.get(trace_id)
            self.send(too_many)
            if rehome is not None:
                item = _rehomed(item, rehome)
        self.send([item])

    def send(self, items: Sequence[Held]) -> None:
        spans = [item for item in items if isinstance(item, ReadableSpan)]
        if spans:
            self._inner.on_end_all(spans)  # one hand-over for the lot
        for item in items:
            if not isinstance(item, ReadableSpan):
                self._inner_logs.on_emit(item)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _HeldLogs(LogRecordProcessor):
    def __init__(self, held: HeldSpans) -> None:
        self._held = held

    def on_emit(self, log_record: ReadWriteLogRecord) -> None:
        self._held._pass(log_record, log_record.log_record.trace_id or 0)

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _rehomed(item: Held, rehome: Rehome) -> Held:
    if isinstance(item, ReadableSpan):
        return rehomed(item, rehome)
    record = item.log_record  # emitted once, handed to this one processor: changed in place
    record.trace_id = rehome.trace_id
    if record.span_id == rehome.tentative_root_span_id:
        record.span_id = rehome.root_span_id
    return item


def rehomed(span: ReadableSpan, rehome: Rehome) -> ReadableSpan:
    """``span`` in step N's trace: its trace id, the tentative root's place taken by step N's root,
    and ``ml.step`` the step it served."""
    context, parent = span.context, span.parent
    assert context is not None
    attributes = span.attributes
    if rehome.stamped_step is not None and attributes and attributes.get(STEP) == rehome.stamped_step:
        attributes = {**attributes, STEP: rehome.step}
    parent_id = parent.span_id if parent is not None else rehome.root_span_id
    if parent_id == rehome.tentative_root_span_id:
        parent_id = rehome.root_span_id
    return ReadableSpan(
        name=span.name,
        context=_moved(context, rehome.trace_id, context.span_id),
        parent=_moved(context, rehome.trace_id, parent_id),
        resource=span.resource,
        attributes=attributes,
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def _moved(context: SpanContext, trace_id: int, span_id: int) -> SpanContext:
    return SpanContext(
        trace_id, span_id, is_remote=False, trace_flags=context.trace_flags, trace_state=context.trace_state
    )
