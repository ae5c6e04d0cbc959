"""The trace UI's translation, OTLP/JSON -> Zipkin v2, checked against the OTLP it was given:
every attribute, event, status, link and resource attribute kept, the tree and timings exact."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_tracking_stack.zipkin_spans import any_value, spans_from_otlp

hex16 = st.binary(min_size=8, max_size=8).map(bytes.hex)
hex32 = st.binary(min_size=16, max_size=16).map(bytes.hex)
keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
scalars = st.one_of(
    st.text(max_size=20).map(lambda v: ({"stringValue": v}, v)),
    st.booleans().map(lambda v: ({"boolValue": v}, v)),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: ({"intValue": str(v)}, v)),  # int64 as a string
    st.floats(allow_nan=False).map(lambda v: ({"doubleValue": v}, v)),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3).map(lambda vs: ({"arrayValue": {"values": [v[0] for v in vs]}}, [v[1] for v in vs])),
)
attribute_lists = st.dictionaries(keys, values, max_size=4)
nanos = st.integers(0, 2**62)


def _otlp_attributes(attributes: dict[str, tuple[dict[str, Any], Any]]) -> list[dict[str, Any]]:
    return [{"key": k, "value": v[0]} for k, v in attributes.items()]


def _expected_tag(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


@st.composite
def spans(draw: st.DrawFn, trace_id: str, parent: str | None) -> dict[str, Any]:
    start = draw(nanos)
    end = start + draw(st.integers(0, 10**12))
    span: dict[str, Any] = {
        "traceId": trace_id,
        "spanId": draw(hex16),
        "name": draw(st.text(max_size=20)),
        "kind": draw(st.integers(0, 5)),
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(end),
        "attributes": draw(attribute_lists),
        "events": [
            {"timeUnixNano": str(draw(st.integers(start, end))), "name": draw(st.text(max_size=10)), "attributes": a}
            for a in draw(st.lists(attribute_lists, max_size=2))
        ],
        "links": [
            {"traceId": draw(hex32), "spanId": draw(hex16), "attributes": a}
            for a in draw(st.lists(attribute_lists, max_size=2))
        ],
        "status": draw(st.sampled_from([{}, {"code": 1}, {"code": 2, "message": "boom"}])),
    }
    if parent:
        span["parentSpanId"] = parent
    return span


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    """An ExportTraceServiceRequest: resources, each with scopes, each with a tree of spans."""
    resource_spans = []
    for _ in range(draw(st.integers(1, 2))):
        resource = draw(attribute_lists)
        resource["service.name"] = ({"stringValue": draw(st.text(min_size=1, max_size=10))}, None)
        scope_spans = []
        for _ in range(draw(st.integers(1, 2))):
            trace_id = draw(hex32)
            tree: list[dict[str, Any]] = []
            for _ in range(draw(st.integers(1, 4))):
                parent = draw(st.sampled_from([None, *[s["spanId"] for s in tree]]))
                tree.append(draw(spans(trace_id, parent)))
            scope_spans.append({"scope": {"name": draw(st.text(max_size=8)), "version": "1.0"}, "spans": tree})
        resource_spans.append({"resource": {"attributes": resource}, "scopeSpans": scope_spans})
    return {"resourceSpans": resource_spans}


def _as_otlp(request: dict[str, Any]) -> dict[str, Any]:
    """The drawn request as OTLP/JSON (attribute dicts of (AnyValue, python value) -> key/value lists)."""

    def attrs(a: dict[str, Any]) -> list[dict[str, Any]]:
        return _otlp_attributes(a)

    out = json.loads(json.dumps(request, default=str))  # a deep copy
    for rs, drawn_rs in zip(out["resourceSpans"], request["resourceSpans"], strict=True):
        rs["resource"]["attributes"] = attrs(drawn_rs["resource"]["attributes"])
        for ss, drawn_ss in zip(rs["scopeSpans"], drawn_rs["scopeSpans"], strict=True):
            for span, drawn in zip(ss["spans"], drawn_ss["spans"], strict=True):
                span["attributes"] = attrs(drawn["attributes"])
                for event, drawn_event in zip(span["events"], drawn["events"], strict=True):
                    event["attributes"] = attrs(drawn_event["attributes"])
                for link, drawn_link in zip(span["links"], drawn["links"], strict=True):
                    link["attributes"] = attrs(drawn_link["attributes"])
    return out


@settings(max_examples=150, deadline=None)
@given(requests())
def test_every_span_keeps_its_tree_timings_attributes_events_links_and_resource(request: dict[str, Any]) -> None:
    zipkin = list(spans_from_otlp(_as_otlp(request)))
    drawn = [(rs, ss, span) for rs in request["resourceSpans"] for ss in rs["scopeSpans"] for span in ss["spans"]]
    assert len(zipkin) == len(drawn)
    for out, (rs, ss, span) in zip(zipkin, drawn, strict=True):
        assert (out["traceId"], out["id"], out.get("parentId")) == (
            span["traceId"],
            span["spanId"],
            span.get("parentSpanId"),
        )
        assert out["name"] == span["name"]
        start_us = int(span["startTimeUnixNano"]) // 1000
        end_us = int(span["endTimeUnixNano"]) // 1000
        assert out["timestamp"] == start_us
        assert out["duration"] == max(1, end_us - start_us)
        assert out.get("kind") == {2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}.get(span["kind"])
        resource = rs["resource"]["attributes"]
        assert out["localEndpoint"] == {"serviceName": resource["service.name"][0]["stringValue"]}
        tags = out["tags"]
        for key, (_, value) in span["attributes"].items():
            assert tags[key] == _expected_tag(value)
        for key, (encoded, value) in resource.items():
            if key not in span["attributes"]:  # a span attribute of the same key wins
                assert tags[key] == _expected_tag(any_value(encoded) if value is None else value)
        if ss["scope"]["name"]:
            assert tags["otel.scope.name"] == ss["scope"]["name"]
        assert tags["otel.scope.version"] == "1.0"
        code = span["status"].get("code")
        if code == 2:
            assert (tags["otel.status_code"], tags["error"]) == ("ERROR", "boom")
        elif code == 1:
            assert tags["otel.status_code"] == "OK" and "error" not in tags
        for index, link in enumerate(span["links"]):
            text = f"{link['traceId']}/{link['spanId']}"
            link_attributes = {k: v[1] for k, v in link["attributes"].items()}
            assert tags[f"otel.link.{index}"] == (
                f"{text} {json.dumps(link_attributes, separators=(',', ':'))}" if link_attributes else text
            )
        annotations = out.get("annotations", [])
        assert len(annotations) == len(span["events"])
        for annotation, event in zip(annotations, span["events"], strict=True):
            assert annotation["timestamp"] == int(event["timeUnixNano"]) // 1000
            event_attributes = {k: v[1] for k, v in event["attributes"].items()}
            name = event["name"]
            expected = f"{name} {json.dumps(event_attributes, separators=(',', ':'))}" if event_attributes else name
            assert annotation["value"] == expected
        json.dumps(out, allow_nan=False)  # what the relay posts must be strict JSON


def test_values_otlp_json_spells_as_strings() -> None:
    """int64 as a string, NaN and infinities as strings, nested lists and maps, bytes as base64."""
    assert any_value({"intValue": "9007199254740993"}) == 9007199254740993
    assert math.isnan(any_value({"doubleValue": "NaN"}))
    assert any_value({"doubleValue": "Infinity"}) == math.inf
    assert any_value({"kvlistValue": {"values": [{"key": "a", "value": {"intValue": "1"}}]}}) == {"a": 1}
    assert any_value({"bytesValue": "AAE="}) == "AAE="
    [span] = spans_from_otlp(
        {
            "resourceSpans": [
                {
                    "resource": {"attributes": []},
                    "scopeSpans": [
                        {
                            "spans": [
                                {
                                    "traceId": "0" * 31 + "1",
                                    "spanId": "0" * 15 + "2",
                                    "name": "loss",
                                    "startTimeUnixNano": "1000",
                                    "endTimeUnixNano": "1000",
                                    "attributes": [{"key": "ml.value", "value": {"doubleValue": "NaN"}}],
                                }
                            ]
                        }
                    ],
                }
            ]
        }
    )
    assert span["tags"]["ml.value"] == "NaN"  # a tag, strict JSON; Zipkin takes it as text
    assert span["localEndpoint"] == {"serviceName": "unknown_service"}
    assert span["duration"] == 1  # Zipkin drops a span of duration 0
