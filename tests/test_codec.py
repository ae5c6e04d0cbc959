"""The spool and the bridge link keep OTel data whole: SDK-made spans, log records and metrics
survive encode -> JSON text -> decode field for field (kind, links, scope, events, status, trace
flags and state, sequence attributes as tuples, NaN)."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Metric, NumberDataPoint, Sum
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from otel_tracking.delivery.codec import DECODERS, ENCODERS

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
keys = st.text("abcdefghij._", min_size=1, max_size=8)
scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(), text)
attribute_values = st.one_of(
    scalars,
    st.lists(st.integers(-1000, 1000), max_size=3).map(tuple),
    st.lists(text, max_size=3).map(tuple),
    st.lists(st.floats(allow_nan=False), max_size=3).map(tuple),
)
attributes = st.dictionaries(keys, attribute_values, max_size=4)
span_ids = st.integers(1, 2**64 - 1)
trace_ids = st.integers(1, 2**128 - 1)
contexts = st.builds(
    lambda t, s, sampled, state, remote: SpanContext(
        t, s, is_remote=remote, trace_flags=TraceFlags(1 if sampled else 0), trace_state=TraceState(state)
    ),
    trace_ids,
    span_ids,
    st.booleans(),
    st.lists(
        st.tuples(
            st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True), st.from_regex(r"[a-z0-9]{1,6}", fullmatch=True)
        ),
        max_size=2,
        unique_by=lambda kv: kv[0],
    ),
    st.booleans(),
)


def same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN (attributes may carry it)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def through_json(kind: str, payload: Any) -> Any:
    return DECODERS[kind](json.loads(json.dumps(ENCODERS[kind](payload), default=str)))


@settings(max_examples=150, deadline=None)
@given(
    name=text,
    kind=st.sampled_from(list(SpanKind)),
    parent=st.one_of(st.none(), contexts),
    attrs=attributes,
    events=st.lists(st.tuples(text, attributes), max_size=3),
    links=st.lists(st.tuples(contexts, attributes), max_size=3),
    status=st.sampled_from([Status(StatusCode.UNSET), Status(StatusCode.OK), Status(StatusCode.ERROR, "boom")]),
    scope=st.tuples(keys, st.one_of(st.none(), keys)),
    resource=st.dictionaries(keys, st.one_of(text, st.integers(0, 99)), max_size=3),
)
def test_sdk_spans_survive_the_spool_whole(name, kind, parent, attrs, events, links, status, scope, resource) -> None:
    from opentelemetry import trace

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource(resource), sampler=ALWAYS_ON)  # also under unsampled parents
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(scope[0], scope[1])
    context = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
    span = tracer.start_span(name, context=context, kind=kind, attributes=attrs, links=[Link(c, a) for c, a in links])
    for event_name, event_attributes in events:
        span.add_event(event_name, event_attributes)
    span.set_status(status)
    span.end()
    (original,) = memory.get_finished_spans()
    (copy,) = through_json("spans", [original])

    assert copy.name == original.name and copy.kind == original.kind
    assert copy.context == original.context
    assert copy.context.trace_state.to_header() == original.context.trace_state.to_header()
    assert (copy.parent, copy.parent and copy.parent.is_remote) == (
        original.parent,
        original.parent and original.parent.is_remote,
    )
    assert (copy.start_time, copy.end_time) == (original.start_time, original.end_time)
    assert (copy.status.status_code, copy.status.description) == (
        original.status.status_code,
        original.status.description,
    )
    assert same(dict(copy.attributes), dict(original.attributes))
    assert [(e.name, e.timestamp) for e in copy.events] == [(e.name, e.timestamp) for e in original.events]
    assert all(same(dict(a.attributes), dict(b.attributes)) for a, b in zip(copy.events, original.events, strict=True))
    assert [(link.context, link.context.trace_flags, link.context.trace_state.to_header()) for link in copy.links] == [
        (link.context, link.context.trace_flags, link.context.trace_state.to_header()) for link in original.links
    ]
    assert all(same(dict(a.attributes), dict(b.attributes)) for a, b in zip(copy.links, original.links, strict=True))
    assert copy.instrumentation_scope == original.instrumentation_scope
    assert same(dict(copy.resource.attributes), dict(original.resource.attributes))


def test_log_records_keep_severity_text_scope_and_trace_flags() -> None:
    from opentelemetry import trace
    from opentelemetry._logs import SeverityNumber
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor

    memory = InMemoryLogRecordExporter()
    provider = LoggerProvider(resource=Resource({"service.name": "t"}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(memory))
    parent = SpanContext(7, 9, is_remote=False, trace_flags=TraceFlags(0))
    from opentelemetry._logs import LogRecord

    provider.get_logger("gen", "1.2").emit(
        LogRecord(
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
            severity_number=SeverityNumber.WARN,
            severity_text="WARN",
            body={"input": "q", "score": [1.0, float("nan")]},
            attributes={"tags": ("a", "b")},
            event_name="ml.generation",
        )
    )
    (original,) = memory.get_finished_logs()
    (copy,) = through_json("logs", [original])
    a, b = copy.log_record, original.log_record
    assert (a.severity_number, a.severity_text, a.event_name) == (b.severity_number, b.severity_text, b.event_name)
    assert (a.trace_id, a.span_id, a.trace_flags) == (b.trace_id, b.span_id, b.trace_flags)
    assert same(a.body, b.body) and dict(a.attributes) == dict(b.attributes)
    assert copy.instrumentation_scope == original.instrumentation_scope


def test_metrics_keep_sums_units_and_scopes() -> None:
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    point = NumberDataPoint(attributes={"gpu": 0}, start_time_unix_nano=5, time_unix_nano=9, value=3)
    total = Sum(data_points=[point], aggregation_temporality=AggregationTemporality.CUMULATIVE, is_monotonic=True)
    gauge = Gauge(data_points=[NumberDataPoint(attributes={}, start_time_unix_nano=9, time_unix_nano=9, value=0.5)])
    scope = InstrumentationScope("trainer", "0.3")
    data = MetricsData(
        [
            ResourceMetrics(
                resource=Resource({"service.name": "t"}),
                scope_metrics=[
                    ScopeMetrics(
                        scope=scope,
                        metrics=[Metric("tokens", "seen", "1", total), Metric("loss", None, None, gauge)],
                        schema_url="",
                    )
                ],
                schema_url="",
            )
        ]
    )
    (rm,) = through_json("metrics", data).resource_metrics
    (sm,) = rm.scope_metrics
    assert sm.scope == scope
    tokens, loss = sm.metrics
    assert (tokens.name, tokens.description, tokens.unit) == ("tokens", "seen", "1")
    assert isinstance(tokens.data, Sum) and tokens.data.is_monotonic
    assert tokens.data.aggregation_temporality == AggregationTemporality.CUMULATIVE
    assert tokens.data.data_points == [point]
    assert isinstance(loss.data, Gauge) and loss.data.data_points[0].value == 0.5


@settings(max_examples=200, deadline=None)
@given(
    step=st.integers(0, 2**62),
    numbers=st.dictionaries(keys, st.one_of(st.integers(-(2**53), 2**53), st.floats()), max_size=6),
    others=st.dictionaries(keys.map(lambda k: "o" + k), st.one_of(text, st.lists(st.integers(-9, 9), max_size=3))),
    time_ns=st.integers(0, 2**63 - 1),
)
def test_a_spooled_step_is_the_log_call_again(
    step: int, numbers: dict[str, Any], others: dict[str, Any], time_ns: int
) -> None:
    """Replay turns a spooled step back into the log() call (``step_batch_of``) for a tracker's bulk
    path: what the tracker then writes is what it wrote from the live call."""
    from otel_tracking.signals.steps import StepBatch, step_batch_of

    numbers = {k: v for k, v in numbers.items() if k not in others}
    batch = StepBatch(Resource.create({}), step, numbers, others, time_ns)
    again = step_batch_of(DECODERS["metrics"](json.loads(json.dumps(ENCODERS["metrics"](batch)))))
    assert again is not None
    live, replayed = batch.record(), again.record()
    assert (replayed.step, replayed.others, replayed.time_unix_nano) == (live.step, live.others, live.time_unix_nano)
    assert list(replayed.scalars) == list(live.scalars)
    assert all(same(replayed.scalars[k], v) for k, v in live.scalars.items())


@settings(max_examples=300, deadline=None)
@given(
    step=st.integers(0, 2**62),
    numbers=st.dictionaries(
        st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=10),
        st.one_of(st.booleans(), st.integers(-(2**63), 2**64 - 1), st.integers(2**64, 2**70), st.floats()),
        max_size=8,
    ),
    others=st.dictionaries(keys.map(lambda k: "o" + k), text, max_size=2),
    time_ns=st.integers(0, 2**63 - 1),
)
def test_a_step_record_in_a_trackers_log_is_the_log_call_exactly(
    step: int, numbers: dict[str, Any], others: dict[str, Any], time_ns: int
) -> None:
    """A tracker's log keeps a log() call's numbers exactly, each of its own type and in order
    (as JSON, or packed as doubles where JSON has no form: NaN, infinities; -0.0; ints beyond 2**53
    and beyond 64 bits; bools; keys with quotes, backslashes or any character), and the line the
    writer makes holds the same record as
    ``ENCODERS["step"]``; a record in an older release's form (numbers as a JSON object) still
    reads."""
    from otel_tracking.delivery.codec import step_record_json
    from otel_tracking.signals.steps import StepBatch

    numbers = {k: v for k, v in numbers.items() if k not in others}
    batch = StepBatch(Resource.create({}), step, numbers, others, time_ns)
    record = json.loads(step_record_json(batch))
    assert record["kind"] == "step"
    assert record["data"] == json.loads(json.dumps(ENCODERS["step"](batch)))
    again = DECODERS["step"](record["data"])
    assert (again.step, again.others, again.time_ns) == (step, others, time_ns)
    assert list(again.scalars) == list(numbers)
    for key, value in numbers.items():
        assert same(again.scalars[key], value), key
        if isinstance(value, float):  # -0.0 stays -0.0
            assert math.copysign(1, again.scalars[key]) == math.copysign(1, value), key
    older = {"step": step, "scalars": numbers, "others": record["data"]["others"], "time_ns": time_ns}
    assert all(same(DECODERS["step"](older).scalars[k], v) for k, v in numbers.items())


def test_metric_data_that_is_no_log_call_stays_as_it_is() -> None:
    """An OTLP sink's periodic gauges (each key's last value, with its own time and description) and
    labelled gauges are not one log() call."""
    from otel_tracking.signals.steps import LatestValues, labelled_gauge, step_batch_of, wrap

    latest = LatestValues()
    latest.update(3, {"loss": 0.5}, 10)
    latest.update(4, {"lr": 0.1}, 20)
    snapshot = latest.snapshot(Resource.create({}))
    assert snapshot is not None and step_batch_of(snapshot) is None
    busy = labelled_gauge("anatomy.busy_frac", "1", "busy", "ml.role", {"actor": 0.5}, 1)
    assert step_batch_of(wrap(Resource.create({}), [busy])) is None
    assert step_batch_of(wrap(Resource.create({}), [])) is None
