"""The delivery layer: the one place that calls exporters.

A :class:`Sink` is one backend (file, console, wandb, ...): up to three small synchronous OTel
exporters that share a backend session.  This layer hands them data and keeps one backend's
failure from reaching the training loop or the other backends: every call is guarded, counted,
and reported once.  Threads and queues, where there are any, live here and only here (the OTLP
path's periodic metric export is :class:`PeriodicExport`; the OTLP span/log exporters run under the
SDK's batch processors).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk._logs import LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger("otel_tracking")


@dataclass
class SinkStats:
    delivered: int = 0  # export calls that succeeded
    failed: int = 0  # export calls that raised or returned FAILURE; their data did not arrive
    retried: int = 0
    spooled: int = 0
    dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


_FAILED = (MetricExportResult.FAILURE, SpanExportResult.FAILURE)


class Sink:
    """One backend's exporters, guarded and counted."""

    def __init__(
        self,
        name: str,
        metrics: MetricExporter | None = None,
        spans: SpanExporter | None = None,
        logs: Any = None,
        on_finish: Callable[[int], None] | None = None,
        where: str | None = None,
        named_events_only: bool = False,
    ) -> None:
        self.name = name
        # ML bridges write an event (generations, tables) only when the caller named their backend
        # in its ``ml.backends`` attribute, as the reference did; file and OTLP record every event.
        self.named_events_only = named_events_only
        self.metrics = metrics
        self.spans = spans
        self.logs = logs
        self.where = where  # shown to the user at the end of a run: where this sink wrote
        self._on_finish = on_finish
        self.stats = SinkStats()
        self._lock = threading.Lock()
        self._warned = False
        self._finished = False

    def _call(self, what: str, export: Callable[[Any], Any], payload: Any) -> None:
        try:
            result = export(payload)
        except Exception as error:
            self._count_failure(what, error)
            return
        if result in _FAILED or getattr(result, "name", "") == "FAILURE":
            self._count_failure(what, None)
        else:
            with self._lock:
                self.stats.delivered += 1

    def _count_failure(self, what: str, error: BaseException | None) -> None:
        with self._lock:
            self.stats.failed += 1
            first = not self._warned
            self._warned = True
        message = "otel-tracking: sink %r failed to export %s%s"
        detail = f": {type(error).__name__}: {error}" if error else ""
        if first:
            logger.warning(
                message + " (further failures are counted and reported at finish())", self.name, what, detail
            )
        else:
            logger.debug(message, self.name, what, detail)

    def export_metrics(self, data: MetricsData) -> None:
        if self.metrics is not None:
            self._call("metrics", self.metrics.export, data)

    def export_spans(self, spans: Sequence[ReadableSpan]) -> None:
        if self.spans is not None:
            self._call("spans", self.spans.export, spans)

    def export_logs(self, records: Sequence[ReadableLogRecord]) -> None:
        if self.logs is None:
            return
        if self.named_events_only:
            records = [r for r in records if self._is_named(r)]
            if not records:
                return
        self._call("logs", self.logs.export, records)

    def _is_named(self, item: ReadableLogRecord) -> bool:
        backends = (item.log_record.attributes or {}).get("ml.backends")
        return not isinstance(backends, (list, tuple)) or self.name in backends

    def finish(self, exit_code: int) -> None:
        """Flush and shut down every exporter, then end the backend's run; once."""
        if self._finished:
            return
        self._finished = True
        for exporter in (self.metrics, self.spans, self.logs):
            if exporter is None:
                continue
            try:
                if hasattr(exporter, "force_flush"):
                    exporter.force_flush()
                exporter.shutdown()
            except Exception as error:
                self._count_failure("shutdown", error)
        if self._on_finish is not None:
            try:
                self._on_finish(exit_code)
            except Exception as error:
                self._count_failure("finish", error)


class SinkSpanProcessor(SpanProcessor):
    """Hands each ended span to every sink that takes spans."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._sinks = [sink for sink in sinks if sink.spans is not None]

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        batch = (span,)
        for sink in self._sinks:
            sink.export_spans(batch)

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class SinkLogProcessor(LogRecordProcessor):
    """Hands each emitted log record (generations, tables) to every sink that takes logs."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._sinks = [sink for sink in sinks if sink.logs is not None]

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


class PeriodicExport:
    """Calls ``produce()`` every ``interval_s`` on a daemon thread and hands the result to ``sink``;
    :meth:`stop` does one last export, so the final values always leave."""

    def __init__(self, sink: Sink, produce: Callable[[], MetricsData | None], interval_s: float) -> None:
        self._sink = sink
        self._produce = produce
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"otel-tracking-{sink.name}-metrics", daemon=True)
        self._thread.start()

    def _export_once(self) -> None:
        data = self._produce()
        if data is not None:
            self._sink.export_metrics(data)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._export_once()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._export_once()


class SinkAsSpanExporter(SpanExporter):
    """Lets the SDK's BatchSpanProcessor (the OTLP path's thread and queue) feed a Sink, so OTLP
    exports are guarded and counted like every other sink's."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._sink.export_spans(spans)
        return SpanExportResult.SUCCESS


class SinkAsLogExporter(LogRecordExporter):
    """The same for the SDK's BatchLogRecordProcessor."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        self._sink.export_logs(batch)
        return LogRecordExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        return None
