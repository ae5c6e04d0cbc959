"""OTel data and log() calls to JSON-able dicts and back: the record format of every log.

Spans keep everything an exporter reads: name, kind, ids, trace flags and state, parent (and
whether it was remote), times, status, attributes, events, links, instrumentation scope and
resource.  Log records keep body, severity (number and text), event name, attributes, times, trace
context, scope and resource.  Metrics keep name, description, unit, gauge or sum (with its
temporality and monotonicity), points, scope and resource.  Attribute values that are sequences
come back as tuples, as the SDK stores them; NaN and infinities survive (the spool is written with
Python's json, which keeps them).  ``tests/test_properties.py`` round-trips SDK-made spans.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from otel_tracking.compat.otel_sdk import LogRecord, ReadableLogRecord, SeverityNumber
from otel_tracking.signals.steps import SCOPE, StepBatch, materialize, wrap
from otel_tracking.signals.values import decode_others, encode_others

_NO_RESOURCE = Resource({})
_BIG_ENDIAN = sys.byteorder == "big"

# --- shared pieces -----------------------------------------------------------------------------


def _attributes(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """JSON turned tuples into lists; the SDK keeps sequence attributes as tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in (raw or {}).items()}


def _encode_scope(scope: InstrumentationScope | None) -> list[Any] | None:
    if scope is None:
        return None
    return [scope.name, scope.version, scope.schema_url, dict(scope.attributes or {})]


def _decode_scope(raw: list[Any] | None) -> InstrumentationScope:
    if not raw:
        return SCOPE
    name, version, schema_url, attributes = [*raw, None, None, None][:4]
    return InstrumentationScope(name, version, schema_url or "", _attributes(attributes) or None)


def _encode_context(context: SpanContext | None) -> list[Any] | None:
    if context is None:
        return None
    return [
        format(context.trace_id, "032x"),
        format(context.span_id, "016x"),
        int(context.trace_flags),
        context.trace_state.to_header() if context.trace_state else "",
        context.is_remote,
    ]


def _decode_context(raw: list[Any] | None) -> SpanContext | None:
    if not raw:
        return None
    trace_id, span_id, flags, state, remote = raw
    return SpanContext(
        int(trace_id, 16),
        int(span_id, 16),
        is_remote=bool(remote),
        trace_flags=TraceFlags(flags),
        trace_state=TraceState.from_header([state]) if state else TraceState(),
    )


# --- metrics -----------------------------------------------------------------------------------


def encode_metrics(data: MetricsData | StepBatch) -> dict[str, Any]:
    out = []
    for rm in materialize(data).resource_metrics:
        scopes = []
        for sm in rm.scope_metrics:
            metrics = []
            for metric in sm.metrics:
                if isinstance(metric.data, Sum):
                    shape = ["sum", metric.data.aggregation_temporality.value, metric.data.is_monotonic]
                elif isinstance(metric.data, Gauge):
                    shape = ["gauge"]
                else:  # histograms: no sink of ours takes them
                    continue
                points = [
                    [p.value, dict(p.attributes or {}), p.start_time_unix_nano, p.time_unix_nano]
                    for p in metric.data.data_points
                ]
                metrics.append([metric.name, metric.description, metric.unit, shape, points])
            scopes.append({"scope": _encode_scope(sm.scope), "metrics": metrics})
        out.append({"resource": dict(rm.resource.attributes), "scopes": scopes})
    return {"resource_metrics": out}


def _decode_metric(name: str, description: str, unit: str | None, shape: list[Any], points: list[Any]) -> Metric:
    data_points = [
        NumberDataPoint(attributes=_attributes(attrs), start_time_unix_nano=start, time_unix_nano=t, value=value)
        for value, attrs, start, t in points
    ]
    if shape[0] == "sum":
        data: Gauge | Sum = Sum(
            data_points=data_points,
            aggregation_temporality=AggregationTemporality(shape[1]),
            is_monotonic=bool(shape[2]),
        )
    else:
        data = Gauge(data_points=data_points)
    return Metric(name=name, description=description, unit=unit, data=data)


def decode_metrics(blob: dict[str, Any]) -> MetricsData:
    resource_metrics: list[Any] = []
    for rm in blob["resource_metrics"]:
        resource = Resource(rm["resource"])
        if "metrics" in rm:  # the first spool format (one scope, gauges only)
            old = [_decode_metric(n, d, None, ["gauge"], [[v, a, t, t] for v, a, t in p]) for n, d, p in rm["metrics"]]
            resource_metrics.extend(wrap(resource, old).resource_metrics)
            continue
        scopes = [
            ScopeMetrics(
                scope=_decode_scope(sm["scope"]),
                metrics=[_decode_metric(*metric) for metric in sm["metrics"]],
                schema_url="",
            )
            for sm in rm["scopes"]
        ]
        resource_metrics.append(ResourceMetrics(resource=resource, scope_metrics=scopes, schema_url=""))
    return MetricsData(resource_metrics=resource_metrics)


# --- spans -------------------------------------------------------------------------------------


def encode_spans(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    return [
        {
            "name": span.name,
            "kind": span.kind.name,
            "context": _encode_context(span.get_span_context()),
            "parent": _encode_context(span.parent),
            "start": span.start_time,
            "end": span.end_time,
            "status": span.status.status_code.name,
            "description": span.status.description,
            "attributes": dict(span.attributes or {}),
            "events": [[e.name, dict(e.attributes or {}), e.timestamp] for e in span.events],
            "links": [[_encode_context(link.context), dict(link.attributes or {})] for link in span.links],
            "scope": _encode_scope(span.instrumentation_scope),
            "resource": dict(span.resource.attributes),
            "resource_schema": span.resource.schema_url,
        }
        for span in spans
    ]


def _old_context(trace_id: str | None, span_id: str | None) -> list[Any] | None:
    return [trace_id, span_id, 1, "", False] if trace_id and span_id else None


def decode_spans(blobs: list[dict[str, Any]]) -> list[ReadableSpan]:
    spans = []
    for b in blobs:
        if "context" not in b:  # the first spool format
            b = {**b, "context": _old_context(b["trace_id"], b["span_id"])}
            b["parent"] = _old_context(b["trace_id"], b["parent_span_id"])
        spans.append(
            ReadableSpan(
                name=b["name"],
                context=_decode_context(b["context"]),
                parent=_decode_context(b["parent"]),
                resource=Resource(b["resource"], b.get("resource_schema")),
                attributes=_attributes(b["attributes"]),
                events=[Event(name, _attributes(attrs), timestamp) for name, attrs, timestamp in b["events"]],
                links=[Link(_decode_context(c), _attributes(attrs)) for c, attrs in b.get("links", [])],  # type: ignore[arg-type]
                kind=SpanKind[b.get("kind", "INTERNAL")],
                status=Status(StatusCode[b["status"]], b["description"]),
                start_time=b["start"],
                end_time=b["end"],
                instrumentation_scope=_decode_scope(b.get("scope")),
            )
        )
    return spans


# --- log records -------------------------------------------------------------------------------


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
                "severity_text": r.severity_text,
                "trace_id": r.trace_id,
                "span_id": r.span_id,
                "trace_flags": int(r.trace_flags) if r.trace_flags is not None else None,
                "scope": _encode_scope(item.instrumentation_scope),
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
            flags = TraceFlags(b["trace_flags"] if b.get("trace_flags") is not None else 1)
            span_context = SpanContext(b["trace_id"], b["span_id"], is_remote=False, trace_flags=flags)
            context = trace.set_span_in_context(NonRecordingSpan(span_context))
        record = LogRecord(
            timestamp=b["timestamp"],
            observed_timestamp=b["observed"],
            context=context,
            severity_number=SeverityNumber(b["severity"]) if b["severity"] is not None else None,
            severity_text=b.get("severity_text"),
            body=b["body"],
            attributes=_attributes(b["attributes"]),
            event_name=b["event_name"],
        )
        records.append(
            ReadableLogRecord(
                log_record=record, resource=Resource(b["resource"]), instrumentation_scope=_decode_scope(b.get("scope"))
            )
        )
    return records


# --- one log() call ------------------------------------------------------------------------------


def encode_step(batch: StepBatch) -> dict[str, Any]:
    """A log() call as the trackers' logs keep it: its step, numbers, other values (as
    ``values.encode_others`` makes them) and time.  Whoever reads it gives it its own resource.

    The numbers go as a JSON object (``scalars``), written by orjson (the shortest text that reads
    back as the same double), unless one of them has no JSON form (NaN, an infinity) or orjson
    cannot write it (an int beyond 64 bits): then the floats go as one base64 run of little-endian
    doubles in the order of ``keys``, and the others in ``ints``.  Either way they read back
    exactly, each of its own type."""
    if _json_safe(batch.scalars):
        with contextlib.suppress(orjson.JSONEncodeError):  # an int beyond 64 bits
            orjson.dumps(batch.scalars)
            scalars = dict(batch.scalars)
            return {"step": batch.step, "scalars": scalars, "others": _others(batch), "time_ns": batch.time_ns}
    keys, floats, ints = _packed(batch)
    return {
        "step": batch.step,
        "keys": list(keys),
        "floats": floats,
        "ints": ints,
        "others": _others(batch),
        "time_ns": batch.time_ns,
    }


def step_record_json(batch: StepBatch) -> bytes:
    """``{"kind": "step", "data": encode_step(batch)}`` as JSON, made on the training thread for
    every log() call: with orjson when the numbers allow it (about half the time the packed form
    takes for 200 numbers)."""
    if _json_safe(batch.scalars):
        record = {"step": int(batch.step), "scalars": batch.scalars, "others": _others(batch), "time_ns": batch.time_ns}
        with contextlib.suppress(orjson.JSONEncodeError):  # an int beyond 64 bits
            return orjson.dumps({"kind": "step", "data": record})
    keys, floats, ints = _packed(batch)
    keys_json = _KEYS_JSON.get(keys)
    if keys_json is None:
        if len(_KEYS_JSON) >= 64:
            _KEYS_JSON.clear()
        keys_json = _KEYS_JSON[keys] = json.dumps(keys)
    return (
        f'{{"kind": "step", "data": {{"step": {int(batch.step)}, "keys": {keys_json}, "floats": "{floats}", '
        f'"ints": {json.dumps(ints, default=str) if ints else "{}"}, "others": {json.dumps(_others(batch))}, '
        f'"time_ns": {int(batch.time_ns)}}}}}'
    ).encode()


_KEYS_JSON: dict[tuple[str, ...], str] = {}  # the key lists seen lately, as JSON


def _json_safe(scalars: Mapping[str, int | float]) -> bool:
    """Whether every number has a JSON form: their sum is finite exactly when each is (or it
    overflows, and the packed form is used all the same).  Ints beyond 64 bits pass here; orjson
    refuses them."""
    try:
        return math.isfinite(sum(scalars.values()))
    except OverflowError:  # an int too large for a double
        return False


def _others(batch: StepBatch) -> Any:
    others = batch.others_json
    if others is None and batch.others:
        others = encode_others(batch.others)
    return others


def _packed(batch: StepBatch) -> tuple[tuple[str, ...], str, dict[str, Any]]:
    values = list(batch.scalars.values())
    if set(map(type, values)) <= {float}:
        floats, ints = array("d", values), {}
    else:
        floats = array("d", [value for value in values if type(value) is float])
        ints = {key: value for key, value in batch.scalars.items() if type(value) is not float}
    if _BIG_ENDIAN:
        floats.byteswap()
    return tuple(batch.scalars), base64.b64encode(floats.tobytes()).decode("ascii"), ints


def decode_step(blob: dict[str, Any], resource: Resource = _NO_RESOURCE) -> StepBatch:
    others_json = blob.get("others")
    others = decode_others(others_json) if others_json else {}
    if "keys" in blob:
        floats = array("d")
        floats.frombytes(base64.b64decode(blob["floats"]))
        if _BIG_ENDIAN:
            floats.byteswap()
        ints, in_order = blob["ints"], iter(floats)
        scalars = {key: ints[key] if key in ints else next(in_order) for key in blob["keys"]}
    else:  # an older release's record: the numbers as a JSON object
        scalars = blob["scalars"]
    return StepBatch(resource, int(blob["step"]), scalars, others, int(blob["time_ns"]), None, others_json)


def _as_is(value: Any) -> Any:
    return value


# "end" is not an item: the spool's last record when the run ended without its tracker ending the
# backend's run (the bridge process was gone), ``{"exit_code": n}``; replay ends the run with it.
ENCODERS: dict[str, Callable[[Any], Any]] = {
    "step": encode_step,
    "metrics": encode_metrics,
    "spans": encode_spans,
    "logs": encode_logs,
    "end": _as_is,
}
DECODERS: dict[str, Callable[[Any], Any]] = {
    "step": decode_step,
    "metrics": decode_metrics,
    "spans": decode_spans,
    "logs": decode_logs,
    "end": _as_is,
}
