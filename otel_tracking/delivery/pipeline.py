"""The delivery layer: the one place that calls exporters.

A :class:`Sink` is one backend (file, console, wandb, OTLP, ...): its exporters (up to three, one per
signal, sharing a backend session) behind one guarded, counted call, :meth:`Sink.deliver` (and
its bulk path for a tracker that takes many steps at once, which its log's reader calls).  How a record gets
there depends on the sink:

- file and console are called inline, on the caller's thread: on disk when ``log()`` returns;
- an ML tracker's records go to its log (its ``transport``: ``tracker_logs.py``, or the bridge
  process's side, ``bridges/process.py``), whose reader calls ``deliver`` (``reader.py``);
- an OTel exporter's sink (OTLP, ``OTEL_*_EXPORTER``) gets a :class:`~otel_tracking.delivery.engine.SinkQueue`.

Of the other threads that export, the periodic OTLP gauge export is the SDK's reader
(:func:`periodic_export`); the SIGTERM watcher (``runtime/lifecycle.py``) and the actor drain
(``distributed/drain.py``) have their own (docs/reference/guarantees.md, "Never block, never lose",
lists them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from opentelemetry.context import Context
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricReader, MetricsData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_tracking.compat.otel_sdk import LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord, periodic_reader
from otel_tracking.config.policy import Policy
from otel_tracking.delivery.engine import SinkQueue
from otel_tracking.delivery.spool import Spool, item_count
from otel_tracking.exporters._base import SinkParts
from otel_tracking.signals import semconv
from otel_tracking.signals.redact import scrubbed_logger
from otel_tracking.signals.steps import StepBatch, materialize

logger = scrubbed_logger()  # what it says is scrubbed (an endpoint or an error can quote credentials)


@dataclass
class SinkStats:
    """Items (one per log() call, span or log record) and what became of them."""

    delivered: int = 0  # exported successfully
    failed: int = 0  # export attempts that raised or returned FAILURE (each is retried or spooled)
    retried: int = 0  # attempts after the first
    spooled: int = 0  # kept on disk for ``otel-tracking replay``
    dropped: int = 0  # lost: queue full with no spool, or the spool itself failed

    def add(self, field: str, n: int) -> None:
        """``n`` more of ``field``: an item's outcome ("delivered", "spooled", "dropped") or an
        export attempt ("failed", "retried")."""
        if field == "delivered":
            self.delivered += n
        elif field == "failed":
            self.failed += n
        elif field == "retried":
            self.retried += n
        elif field == "spooled":
            self.spooled += n
        elif field == "dropped":
            self.dropped += n
        else:
            raise ValueError(f"not a count: {field!r}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


_FAILED = (MetricExportResult.FAILURE, SpanExportResult.FAILURE)


class Transport(Protocol):
    """What takes items for several sinks at once (the trackers' logs: ``spool.LogWriter``): one
    item, the names of the sinks it is for."""

    def submit(self, names: Sequence[str], kind: str, payload: Any) -> None: ...


class SharedLogs(Protocol):
    """Who reads the logs of several trackers (``tracker_logs.LocalTrackers``, or the bridge
    process, ``bridges/process.py``): their sinks' ``flush`` and ``finish`` (called once for each
    of them: the first does the work)."""

    def flush(self, timeout_s: float) -> bool: ...

    def finish(self, exit_code: int, timeout_s: float) -> None: ...


@dataclass(frozen=True)
class Exporters:
    """One backend's exporters (each optional) and what they can do beyond ``export``, read once,
    when they are set, not probed at every call."""

    metrics: Any = None
    spans: Any = None
    logs: Any = None
    step_records: Callable[..., Any] | None = None  # our step exporters take log() records as they are
    bulk: Callable[..., Any] | None = None  # ... and several steps at once (MLflow: up to 1,000 metrics a request)
    flushers: tuple[Callable[[], Any], ...] = ()  # the exporters' force_flush, called before shutdown

    @classmethod
    def of(cls, metrics: Any = None, spans: Any = None, logs: Any = None) -> Exporters:
        step_records = _method(metrics, "export_records")
        return cls(
            metrics,
            spans,
            logs,
            step_records=step_records,
            bulk=_method(metrics, "export_many") if step_records is not None else None,
            flushers=tuple(f for e in (metrics, spans, logs) if (f := _method(e, "force_flush")) is not None),
        )

    def of_kind(self, kind: str) -> Any:
        """The exporter of ``kind`` ("metrics", "spans" or "logs"), or None."""
        return {"metrics": self.metrics, "spans": self.spans, "logs": self.logs}[kind]

    def only(self, kinds: set[str]) -> Exporters:
        """These exporters but for the kinds not in ``kinds``."""
        return Exporters.of(*(self.of_kind(kind) if kind in kinds else None for kind in ("metrics", "spans", "logs")))

    def __iter__(self) -> Iterator[Any]:
        return (e for e in (self.metrics, self.spans, self.logs) if e is not None)


def _method(exporter: Any, name: str) -> Callable[..., Any] | None:
    method = getattr(exporter, name, None) if exporter is not None else None
    return method if callable(method) else None


class Sink:
    """One backend, guarded and counted; inline or behind a queue.  ``parts``: its exporters, the
    call that ends its run, where it writes, how to reattach (what a tracker's ``open_tracker``
    returns); none yet for a tracker still opening (:meth:`attach`).  ``inline``: called on the
    caller's thread (file, console: on disk when log() returns).  ``named_events_only``: an ML
    tracker writes an event (generations, tables) only when the caller named its backend in the
    ``ml.backends`` attribute, as the reference did; file and OTLP record every event.
    ``policy``: this sink's own retry policy, instead of the run's."""

    def __init__(
        self,
        name: str,
        parts: SinkParts | None = None,
        *,
        inline: bool = False,
        named_events_only: bool = False,
        policy: Policy | None = None,
    ) -> None:
        self.name = name
        self.inline = inline
        self.named_events_only = named_events_only
        self.policy = policy
        self._take(parts or SinkParts())
        # Told (name, resume) when a tracker opened after the run started: the run's reattach record.
        self.on_resume: Callable[[str, dict[str, Any] | None], Any] | None = None
        self.transport: Transport | None = None  # set when its exporters are elsewhere (see export_to)
        self.owner: SharedLogs | None = None  # ... and who reads what it was handed: its flush and finish
        self.stats = SinkStats()
        self.queue: SinkQueue | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._finished = False
        self._sealed = False  # finished past its exporters: a tracker opening now is too late

    def _take(self, parts: SinkParts) -> None:
        self.exporters = Exporters.of(parts.metrics, parts.spans, parts.logs)
        self._on_finish = parts.finish
        self.where = parts.where  # shown to the user at the end of a run: where this sink wrote
        self.resume = parts.resume  # what replay needs to reattach to this backend's run (an MLflow run id)
        self.unreachable = parts.unreachable  # takes every kind, kept in its log for replay (see SinkParts)

    def start(self, spool: Spool | None, policy: Policy | None = None) -> None:
        """Give an OTel exporter's sink its queue (the run does this once its spool path is known);
        an inline sink and a tracker's (whose transport is its log) need none."""
        if not self.inline and self.queue is None and self.transport is None:
            self.queue = SinkQueue(self.name, self.deliver, self.count, spool, policy)

    def attach(self, parts: SinkParts) -> bool:
        """Take the exporters of the tracker that just opened (in the bridge process: its log's
        reader starts then).  False when the sink was finished first: the caller ends the late run."""
        with self._lock:
            if self._sealed:
                return False
        # The run's record first: once the sink says where it writes, a job killed can resume into it.
        if self.on_resume is not None:
            self.on_resume(self.name, parts.resume)
        with self._lock:
            if self._sealed:
                return False
            self._take(parts)
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until what was handed to this sink so far is delivered or spooled."""
        if self.owner is not None:
            return self.owner.flush(timeout_s)
        return self.queue.flush(timeout_s) if self.queue is not None else True

    @property
    def metrics(self) -> Any:
        return self.exporters.metrics

    @property
    def spans(self) -> Any:
        return self.exporters.spans

    @property
    def logs(self) -> Any:
        return self.exporters.logs

    def takes(self, kind: str) -> bool:
        """Whether this sink exports ``kind`` ("metrics", "spans" or "logs"); a backend that did not
        answer at open takes every kind, into its spool."""
        return self.unreachable or self.exporters.of_kind(kind) is not None

    def count(self, field: str, n: int) -> None:
        with self._lock:
            self.stats.add(field, n)

    def deliver(self, kind: str, payload: Any) -> bool:
        """One guarded export call; True when the backend took it (the caller counts it delivered:
        the queue thread, which may have given the item up meanwhile, or the inline path)."""
        exporters = self.exporters
        try:
            if kind != "metrics":
                result = exporters.of_kind(kind).export(payload)
            elif isinstance(payload, StepBatch) and exporters.step_records is not None:
                result = exporters.step_records([payload.record()])  # no OTel round trip
            else:
                result = exporters.metrics.export(materialize(payload))
        except Exception as error:
            self.count_failure(kind, error)
            return False
        if result in _FAILED or getattr(result, "name", "") == "FAILURE":
            self.count_failure(kind, None)
            return False
        return True

    def _submit(self, kind: str, payload: Any) -> None:
        if self.transport is not None:
            self.transport.submit([self.name], kind, payload)
        elif self.queue is not None:
            self.queue.submit(kind, payload)
        elif self.deliver(kind, payload):
            self.count("delivered", item_count(kind, payload))

    def count_failure(self, what: str, error: BaseException | None) -> None:
        """An export that failed: counted, and the first one said (scrubbed)."""
        with self._lock:
            self.stats.failed += 1
            first = not self._warned
            self._warned = True
        message = "otel-tracking: sink %r failed to export %s%s"
        detail = f": {type(error).__name__}: {error}" if error else ""  # scrubbed by the logger
        if first:
            logger.warning(
                message + " (further failures are counted in the summary at the end)", self.name, what, detail
            )
        else:
            logger.debug(message, self.name, what, detail)

    def export_metrics(self, data: MetricsData | StepBatch) -> None:
        if self.takes("metrics"):
            self._submit("metrics", data)

    def export_spans(self, spans: Sequence[ReadableSpan]) -> None:
        if self.takes("spans"):
            self._submit("spans", spans)

    def export_logs(self, records: Sequence[ReadableLogRecord]) -> None:
        if not self.takes("logs"):
            return
        if self.named_events_only:
            records = [r for r in records if self._is_named(r)]
            if not records:
                return
        self._submit("logs", records)

    def _is_named(self, item: ReadableLogRecord) -> bool:
        backends = (item.log_record.attributes or {}).get(semconv.EVENT_BACKENDS)
        return not isinstance(backends, (list, tuple)) or self.name in backends

    def finish(self, exit_code: int, timeout_s: float = 30.0, since: float | None = None) -> None:
        """Drain the queue while the backend makes progress (spooling what a backend that
        delivered nothing for ``timeout_s``, counted from ``since`` or now, still holds), flush and
        shut down every exporter, then end the backend's run; once."""
        if self._finished:
            return
        self._finished = True
        if self.owner is not None:  # its log delivered while the backend makes progress, counted
            self.owner.finish(exit_code, timeout_s)
        if self.queue is not None:
            self.queue.stop(timeout_s, since)
        with self._lock:
            self._sealed = True
        exporters = self.exporters
        for flush in exporters.flushers:
            try:
                flush()
            except Exception as error:
                self.count_failure("shutdown", error)
        for exporter in exporters:
            try:
                exporter.shutdown()
            except Exception as error:
                self.count_failure("shutdown", error)
        if self._on_finish is not None:
            try:
                self._on_finish(exit_code)
            except Exception as error:
                self.count_failure("finish", error)


def export_to(sinks: Sequence[Sink], kind: str, payload: Any) -> None:
    """Hand one item ("metrics" or "spans") to each of ``sinks`` that takes it; the sinks of one
    transport (the trackers in the bridge process) get it as one message for all of them."""
    shared: dict[int, tuple[Transport, list[str]]] = {}
    for sink in sinks:
        if not sink.takes(kind):
            continue
        if sink.transport is None:
            sink._submit(kind, payload)
        else:
            shared.setdefault(id(sink.transport), (sink.transport, []))[1].append(sink.name)
    for transport, names in shared.values():
        transport.submit(names, kind, payload)


def flush_sinks(sinks: Sequence[Sink], deadline: float) -> bool:
    """Wait for every sink's queue at once until ``deadline`` (monotonic); False if one was not
    empty by then (every sink is waited for, none skipped)."""
    return all([sink.flush(max(0.0, deadline - time.monotonic())) for sink in sinks])


PROGRESS_AFTER_S = 5.0  # finish() says what it is waiting for once it has drained this long, and again


def drain_sinks(sinks: Sequence[Sink], stall_s: float, since: float) -> None:
    """Wait for every sink's queue at once, each for as long as its backend makes progress (see
    ``SinkQueue.drain``): a backend that delivered nothing for ``stall_s`` is no longer waited for.
    Every ``PROGRESS_AFTER_S`` one line says which backends are still delivering."""
    waiting = [sink for sink in sinks if sink.queue is not None]
    next_line = since + PROGRESS_AFTER_S
    while waiting:
        queue = waiting[0].queue
        assert queue is not None
        state = queue.drain(stall_s, since, wait_s=max(0.0, next_line - time.monotonic()))
        if state != "moving":
            waiting.pop(0)
            continue
        now = time.monotonic()
        if now >= next_line:
            next_line = now + PROGRESS_AFTER_S
            left = ", ".join(f"{s.name} ({s.queue.backlog()} items left)" for s in waiting if s.queue is not None)
            logger.warning(
                "otel-tracking: finishing for %.0f s: still delivering to %s; waiting while they make progress "
                "(what a backend that delivers nothing for %g s still holds is spooled)",
                now - since,
                left,
                stall_s,
            )


def finish_sinks(sinks: Sequence[Sink], exit_code: int, stall_s: float) -> None:
    """Drain every sink's queue at once while its backend makes progress, then finish them one by
    one; what a backend that delivered nothing for ``stall_s`` still holds is spooled."""
    since = time.monotonic()
    drain_sinks(sinks, stall_s, since)
    for sink in sinks:
        sink.finish(exit_code, timeout_s=stall_s, since=since)


class SinkSpanProcessor(SpanProcessor):
    """Hands each ended span to every sink that takes spans."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._sinks = [sink for sink in sinks if sink.takes("spans")]

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        export_to(self._sinks, "spans", (span,))

    def on_end_all(self, spans: Sequence[ReadableSpan]) -> None:
        """Spans that ended earlier and were held (``runtime/held_spans.py``), handed on as one item."""
        export_to(self._sinks, "spans", tuple(spans))

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class SinkLogProcessor(LogRecordProcessor):
    """Hands each emitted log record (generations, tables) to every sink that takes logs."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._sinks = [sink for sink in sinks if sink.takes("logs")]

    def on_emit(self, log_record: ReadWriteLogRecord) -> None:
        readable = ReadableLogRecord(
            log_record=log_record.log_record,
            resource=log_record.resource if log_record.resource is not None else Resource({}),
            instrumentation_scope=log_record.instrumentation_scope,
            limits=log_record.limits,
        )
        batch = (readable,)
        for sink in self._sinks:
            sink.export_logs(batch)

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class _ToSink(MetricExporter):
    """A metric exporter that hands what the SDK's periodic reader collects to a sink."""

    def __init__(self, sink: Sink) -> None:
        super().__init__()
        self._sink = sink

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self._sink.export_metrics(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None  # the run finishes the sink itself, after the last export


def periodic_export(sink: Sink, produce: Callable[[], MetricsData | None], interval_s: float) -> MetricReader:
    """Hands ``produce()`` to ``sink`` every ``interval_s`` (the SDK's periodic reader);
    ``shutdown()`` exports once more, so the final values always leave."""
    return periodic_reader(_ToSink(sink), produce, interval_s)
