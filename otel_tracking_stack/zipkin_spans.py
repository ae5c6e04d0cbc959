"""OTLP/JSON traces -> Zipkin v2 JSON spans: what the stack's trace UI (Zipkin) is fed.

Zipkin has no OTLP intake, so the collector sends the stack's traces as OTLP/JSON
(``otlp_http/trace_ui`` in ``collector-config.yaml``) to ``zipkin_relay.py``, which translates
them here and posts them to Zipkin's ``/api/v2/spans``.  Standard library only.

The mapping (nothing the OTLP carried is dropped; Zipkin has no place for some of it, so those
go into tags with an ``otel.`` prefix, as the collector's own Zipkin exporter does):

- ids, parent, name: as they are (hex).  ``kind``: SERVER, CLIENT, PRODUCER, CONSUMER; INTERNAL
  and unset have no Zipkin kind and are omitted.
- times: Zipkin counts microseconds.  ``timestamp`` is the start's microsecond (rounded down),
  ``duration`` the end's microsecond minus it, at least 1 (Zipkin drops a zero duration).
- ``localEndpoint.serviceName``: the resource's ``service.name`` (Zipkin lowercases it).
- tags: every span attribute; every resource attribute (a span attribute of the same key wins);
  the scope as ``otel.scope.name``/``otel.scope.version``; the status as ``otel.status_code``
  (``OK``/``ERROR``) and ``error`` (its message) when it is an error; links as
  ``otel.link.<i>`` = ``<traceId>/<spanId>`` with their attributes as JSON; ``otel.trace_state``
  when set.  Values that are not strings become JSON text (Zipkin tags are strings).
- events: annotations, ``value`` = the event's name, then its attributes as JSON when it has any.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["any_value", "attributes", "spans_from_otlp"]

# OTLP's SpanKind enum -> Zipkin's kind (INTERNAL = 1 and UNSPECIFIED = 0 have none).
_KINDS = {2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_KIND_NAMES = {"SPAN_KIND_SERVER": 2, "SPAN_KIND_CLIENT": 3, "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5}
_STATUS = {1: "OK", 2: "ERROR", "STATUS_CODE_OK": "OK", "STATUS_CODE_ERROR": "ERROR"}


def any_value(value: Mapping[str, Any]) -> Any:
    """An OTLP/JSON ``AnyValue`` as a Python value (int64s arrive as strings in OTLP/JSON)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        double = value["doubleValue"]
        return float(double) if isinstance(double, str) else double  # "NaN", "Infinity" as strings
    if "arrayValue" in value:
        return [any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return attributes(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]  # base64, as OTLP/JSON has it
    return None


def attributes(items: Any) -> dict[str, Any]:
    """An OTLP/JSON attribute list as a dict."""
    return {item["key"]: any_value(item.get("value", {})) for item in items or ()}


def _tag(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), allow_nan=True)


def _micros(nanos: Any) -> int:
    return int(nanos or 0) // 1000


def _kind(kind: Any) -> str | None:
    if isinstance(kind, str):
        kind = _KIND_NAMES.get(kind, 0)
    return _KINDS.get(int(kind or 0))


def _span(
    span: Mapping[str, Any], service: str, resource_tags: Mapping[str, str], scope: Mapping[str, Any]
) -> dict[str, Any]:
    start = _micros(span.get("startTimeUnixNano"))
    end = _micros(span.get("endTimeUnixNano"))
    tags = dict(resource_tags)
    if scope.get("name"):
        tags["otel.scope.name"] = str(scope["name"])
    if scope.get("version"):
        tags["otel.scope.version"] = str(scope["version"])
    tags.update({key: _tag(value) for key, value in attributes(span.get("attributes")).items()})
    status = span.get("status") or {}
    code = _STATUS.get(status.get("code", 0))
    if code:
        tags["otel.status_code"] = code
        if code == "ERROR":
            tags["error"] = status.get("message", "")
    for index, link in enumerate(span.get("links") or ()):
        text = f"{link.get('traceId', '')}/{link.get('spanId', '')}"
        link_attributes = attributes(link.get("attributes"))
        tags[f"otel.link.{index}"] = f"{text} {_tag(link_attributes)}" if link_attributes else text
    if span.get("traceState"):
        tags["otel.trace_state"] = span["traceState"]
    out: dict[str, Any] = {
        "traceId": span["traceId"],
        "id": span["spanId"],
        "name": span.get("name", ""),
        "timestamp": start,
        "duration": max(1, end - start),
        "localEndpoint": {"serviceName": service},
        "tags": tags,
    }
    if span.get("parentSpanId"):
        out["parentId"] = span["parentSpanId"]
    kind = _kind(span.get("kind"))
    if kind:
        out["kind"] = kind
    annotations = []
    for event in span.get("events") or ():
        event_attributes = attributes(event.get("attributes"))
        value = event.get("name", "")
        if event_attributes:
            value = f"{value} {_tag(event_attributes)}"
        annotations.append({"timestamp": _micros(event.get("timeUnixNano")), "value": value})
    if annotations:
        out["annotations"] = annotations
    return out


def spans_from_otlp(payload: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every span of an OTLP/JSON ``ExportTraceServiceRequest``, as a Zipkin v2 span."""
    for resource_spans in payload.get("resourceSpans") or ():
        resource = attributes((resource_spans.get("resource") or {}).get("attributes"))
        service = str(resource.get("service.name") or "unknown_service")
        resource_tags = {key: _tag(value) for key, value in resource.items()}
        for scope_spans in resource_spans.get("scopeSpans") or ():
            scope = scope_spans.get("scope") or {}
            for span in scope_spans.get("spans") or ():
                yield _span(span, service, resource_tags, scope)
