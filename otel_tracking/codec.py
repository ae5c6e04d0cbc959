"""OTel data to JSON-able dicts and back, for the spool (what a sink could not take, kept on disk).

Only what the bridges and OTLP exporters read survives the round trip: for metrics, gauge points
(name, description, value, attributes, times) and the resource; for spans, name, ids, parent,
times, status, attributes, events and resource; for log records, event name, body, attributes,
times, trace context and resource.  NaN and infinities survive (the spool is written with
Python's json, which keeps them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import Gauge, Metric, MetricsData, NumberDataPoint, Sum
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_tracking.otel_compat import LogRecord, ReadableLogRecord, SeverityNumber
from otel_tracking.steps import SCOPE, StepBatch, materialize, wrap


def encode_metrics(data: MetricsData | StepBatch) -> dict[str, Any]:
    out = []
    for rm in materialize(data).resource_metrics:
        metrics = []
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if not isinstance(metric.data, (Gauge, Sum)):
                    continue
                points = [[p.value, dict(p.attributes or {}), p.time_unix_nano] for p in metric.data.data_points]
                metrics.append([metric.name, metric.description, points])
        out.append({"resource": dict(rm.resource.attributes), "metrics": metrics})
    return {"resource_metrics": out}


def decode_metrics(blob: dict[str, Any]) -> MetricsData:
    resource_metrics: list[Any] = []
    for rm in blob["resource_metrics"]:
        metrics = [
            Metric(
                name=name,
                description=description,
                unit=None,
                data=Gauge(
                    data_points=[
                        NumberDataPoint(attributes=attrs, start_time_unix_nano=t, time_unix_nano=t, value=value)
                        for value, attrs, t in points
                    ]
                ),
            )
            for name, description, points in rm["metrics"]
        ]
        resource_metrics.extend(wrap(Resource(rm["resource"]), metrics).resource_metrics)
    return MetricsData(resource_metrics=resource_metrics)


def _context(trace_id: str | None, span_id: str | None) -> SpanContext | None:
    if not trace_id or not span_id:
        return None
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=False, trace_flags=TraceFlags(1))


def encode_spans(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    out = []
    for span in spans:
        context, parent = span.get_span_context(), span.parent
        out.append(
            {
                "name": span.name,
                "trace_id": format(context.trace_id, "032x") if context else None,
                "span_id": format(context.span_id, "016x") if context else None,
                "parent_span_id": format(parent.span_id, "016x") if parent else None,
                "start": span.start_time,
                "end": span.end_time,
                "status": span.status.status_code.name,
                "description": span.status.description,
                "attributes": dict(span.attributes or {}),
                "events": [[e.name, dict(e.attributes or {}), e.timestamp] for e in span.events],
                "resource": dict(span.resource.attributes),
            }
        )
    return out


def decode_spans(blobs: list[dict[str, Any]]) -> list[ReadableSpan]:
    spans = []
    for b in blobs:
        parent = _context(b["trace_id"], b["parent_span_id"])
        spans.append(
            ReadableSpan(
                name=b["name"],
                context=_context(b["trace_id"], b["span_id"]),
                parent=parent,
                resource=Resource(b["resource"]),
                attributes=b["attributes"],
                events=[Event(name, attrs, timestamp) for name, attrs, timestamp in b["events"]],
                kind=SpanKind.INTERNAL,
                status=Status(StatusCode[b["status"]], b["description"]),
                start_time=b["start"],
                end_time=b["end"],
                instrumentation_scope=SCOPE,
            )
        )
    return spans


def encode_logs(records: Sequence[ReadableLogRecord]) -> list[dict[str, Any]]:
    out = []
    for item in records:
        r = item.log_record
        out.append(
            {
                "event_name": r.event_name,
                "body": r.body,
                "attributes": dict(r.attributes or {}),
                "timestamp": r.timestamp,
                "observed": r.observed_timestamp,
                "severity": r.severity_number.value if r.severity_number is not None else None,
                "trace_id": r.trace_id,
                "span_id": r.span_id,
                "resource": dict(item.resource.attributes),
            }
        )
    return out


def decode_logs(blobs: list[dict[str, Any]]) -> list[ReadableLogRecord]:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan

    records = []
    for b in blobs:
        context = None
        if b.get("trace_id") and b.get("span_id"):
            span_context = SpanContext(b["trace_id"], b["span_id"], is_remote=False, trace_flags=TraceFlags(1))
            context = trace.set_span_in_context(NonRecordingSpan(span_context))
        record = LogRecord(
            timestamp=b["timestamp"],
            observed_timestamp=b["observed"],
            context=context,
            severity_number=SeverityNumber(b["severity"]) if b["severity"] is not None else None,
            body=b["body"],
            attributes=b["attributes"],
            event_name=b["event_name"],
        )
        records.append(
            ReadableLogRecord(log_record=record, resource=Resource(b["resource"]), instrumentation_scope=SCOPE)
        )
    return records


ENCODERS: dict[str, Callable[[Any], Any]] = {"metrics": encode_metrics, "spans": encode_spans, "logs": encode_logs}
DECODERS: dict[str, Callable[[Any], Any]] = {"metrics": decode_metrics, "spans": decode_spans, "logs": decode_logs}
