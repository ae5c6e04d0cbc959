"""JSONL file sink.

The metrics file keeps the reference's exact line format and path rules, so existing readers keep
working: one line ``{"step": s, "data": {...}}`` per log() call, at ``VERL_FILE_LOGGER_PATH`` or
``<VERL_FILE_LOGGER_ROOT or .>/<project>/<experiment>.jsonl``.  Each line is one unbuffered write,
so every step whose log() returned is on disk even if the process is killed.

A resumed run (``OTEL_TRACKING_RESUME``) appends instead of truncating, and before its first step
line writes one marker line ``{"resumed_from_step": s - 1, "attempt": n}`` (``s``: that first
step).  Lines above the marker at steps above ``resumed_from_step`` are superseded: a reader that
keeps the last value of each (key, step) in file order reads the run as the resumed job left it
(``otel_tracking.exporters.file.read_metrics`` does that).

Spans and log records (validation generations, tables) go to the sibling file
``<experiment>.events.jsonl``, one JSON object per line with a ``"type"`` of ``"span"`` or ``"log"``,
never into the metrics file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, BinaryIO

import orjson
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_tracking import settings
from otel_tracking.exporters._base import StepMetricExporter, StepRecord, hex_id, span_duration_s
from otel_tracking.otel_compat import LogRecordExporter, LogRecordExportResult, ReadableLogRecord

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def events_path(metrics_path: Path) -> Path:
    name = metrics_path.name
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return metrics_path.with_name(f"{stem}.events.jsonl")


class FileSink:
    """The two files of one run.  Opened lazily; the metrics file is truncated when opened (as the
    reference did), the events file is appended to, so separately built span and log exporters
    can share it."""

    def __init__(self, path: Path | str | None = None, attempt: int | None = None) -> None:
        """``attempt``: this run resumes an earlier one (append, and mark where this attempt starts)."""
        if path is None:
            path = settings.file_sink_path(*settings.identity_from_env())
        self.path = Path(path)
        self.attempt = attempt
        self._marked = attempt is None
        self.events_path = events_path(self.path)
        self._metrics: IO[bytes] | None = None
        self._events: BinaryIO | None = None
        self._lock = threading.Lock()

    def open(self) -> None:
        with self._lock:
            self._open_metrics()

    def _open_metrics(self) -> IO[bytes]:
        if self._metrics is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            mode = "wb" if self.attempt is None else "ab"  # a resumed run continues the file
            self._metrics = open(self.path, mode, buffering=0)  # noqa: SIM115 - closed in close()
        return self._metrics

    def _open_events(self) -> BinaryIO:
        if self._events is None:
            self.events_path.parent.mkdir(parents=True, exist_ok=True)
            self._events = open(self.events_path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
            os.chmod(self.events_path, 0o644)
        return self._events

    def write_step(self, record: StepRecord) -> None:
        data: dict[str, Any] = dict(record.scalars)
        if record.others:
            data.update(record.others)
        if record.order:  # numbers and other values mixed: the line keeps the caller's key order
            data = {key: data[key] for key in record.order if key in data}
        line = orjson.dumps({"step": record.step, "data": data}, option=_OPTIONS) + b"\n"
        with self._lock:
            if not self._marked:  # the first step of a resumed attempt: where it takes over
                self._marked = True
                line = orjson.dumps({"resumed_from_step": record.step - 1, "attempt": self.attempt}) + b"\n" + line
            self._open_metrics().write(line)

    def write_events(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        blob = b"".join(orjson.dumps(event, option=_OPTIONS, default=str) + b"\n" for event in events)
        with self._lock:
            self._open_events().write(blob)

    def close(self) -> None:
        with self._lock:
            for handle in (self._metrics, self._events):
                if handle is not None:
                    handle.close()
            self._metrics = self._events = None


def read_metrics(path: Path | str) -> dict[str, dict[int, Any]]:
    """``{key: {step: value}}`` of a metrics file, the last value of each (key, step) winning, and
    each resume marker dropping what earlier attempts logged above its ``resumed_from_step``."""
    values: dict[str, dict[int, Any]] = {}
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            line = orjson.loads(raw)
            if "resumed_from_step" in line:
                restart = int(line["resumed_from_step"])
                for steps in values.values():
                    for step in [s for s in steps if s > restart]:
                        del steps[step]
                continue
            for key, value in (line.get("data") or {}).items():
                values.setdefault(key, {})[int(line["step"])] = value
    return values


def span_event(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    parent = span.parent
    return {
        "type": "span",
        "name": span.name,
        "trace_id": hex_id(context.trace_id if context else None, 32),
        "span_id": hex_id(context.span_id if context else None, 16),
        "parent_span_id": hex_id(parent.span_id if parent else None, 16),
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "duration_s": span_duration_s(span),
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
        "resource": dict(span.resource.attributes),
    }


def log_event(item: ReadableLogRecord) -> dict[str, Any]:
    record = item.log_record
    return {
        "type": "log",
        "event_name": record.event_name or "",
        "time_unix_nano": record.timestamp or record.observed_timestamp,
        "severity": record.severity_text,
        "body": record.body,
        "attributes": dict(record.attributes or {}),
        "trace_id": hex_id(record.trace_id, 32) if record.trace_id else None,
        "span_id": hex_id(record.span_id, 16) if record.span_id else None,
        "resource": dict(item.resource.attributes),
    }


class FileMetricExporter(StepMetricExporter):
    def __init__(self, sink: FileSink | None = None) -> None:
        super().__init__()
        self.sink = sink or FileSink()

    def write(self, record: StepRecord) -> None:
        self.sink.write_step(record)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.sink.close()


class FileSpanExporter(SpanExporter):
    def __init__(self, sink: FileSink | None = None) -> None:
        self.sink = sink or FileSink()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.sink.write_events([span_event(span) for span in spans])
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.sink.close()


class FileLogExporter(LogRecordExporter):
    def __init__(self, sink: FileSink | None = None) -> None:
        self.sink = sink or FileSink()

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        self.sink.write_events([log_event(item) for item in batch])
        return LogRecordExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every write is unbuffered

    def shutdown(self) -> None:
        self.sink.close()
