"""How a log() call reaches its consumers.

* :class:`StepBatch` - one ``log()`` call as every sink gets it: the step, its values and its time,
  a handful of objects.  A tracker's log keeps it as that (``codec.encode_step``); a step exporter
  takes its :meth:`StepBatch.record`; any other metric exporter gets :func:`step_batch` built from it.
* :func:`step_batch` - the call as OTel metric data, for a metric exporter that is not ours: one
  ``MetricsData`` per ``log()`` call, holding only that call's keys (so a key logged every 10
  steps appears only at those steps), as gauges named exactly as the caller wrote them, with
  NaN/inf kept, plus the step gauge ``train.step`` first. Building the data directly (instead of
  through the SDK's synchronous gauges and a reader) is what lets one log() be one collection,
  keeps non-finite values, stamps points with the log() time rather than collection time, and
  costs a few microseconds per key.
* :class:`LatestValues` - the observability view for OTLP: every key's last value as a gauge with
  a valid instrument name, re-reported at each periodic export (what Prometheus expects), and the
  step as the gauge ``train.step``, never as an attribute.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics.export import (
    Gauge,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_tracking.signals.semconv import SCOPE_NAME, SCOPE_VERSION, STEP_METRIC
from otel_tracking.signals.semconv import STEP_OTHERS as OTHERS_ATTRIBUTE
from otel_tracking.signals.values import InstrumentNames, decode_others, encode_others

SCOPE = InstrumentationScope(SCOPE_NAME, SCOPE_VERSION)
_NO_ATTRIBUTES: Mapping[str, Any] = {}


def _gauge(
    name: str,
    value: int | float,
    time_ns: int,
    attributes: Mapping[str, Any] = _NO_ATTRIBUTES,
    description: str | None = None,
) -> Metric:
    point = NumberDataPoint(attributes=attributes, start_time_unix_nano=time_ns, time_unix_nano=time_ns, value=value)
    return Metric(name=name, description=description, unit=None, data=Gauge(data_points=[point]))


def wrap(resource: Resource, metrics: list[Metric]) -> MetricsData:
    return MetricsData(
        resource_metrics=[
            ResourceMetrics(
                resource=resource,
                scope_metrics=[ScopeMetrics(scope=SCOPE, metrics=metrics, schema_url="")],
                schema_url="",
            )
        ]
    )


def step_batch(
    resource: Resource,
    step: int,
    scalars: Mapping[str, int | float],
    others: Mapping[str, Any],
    time_ns: int,
    others_json: str | None = None,
) -> MetricsData:
    """``others_json``: ``others`` as :func:`encode_others` wrote them already (log() checked them)."""
    if others and others_json is None:
        others_json = encode_others(others)
    step_attributes = {OTHERS_ATTRIBUTE: others_json} if others_json else _NO_ATTRIBUTES
    metrics = [_gauge(STEP_METRIC, step, time_ns, step_attributes)]
    metrics.extend(_gauge(key, value, time_ns) for key, value in scalars.items())
    return wrap(resource, metrics)


@dataclass
class StepRecord:
    """One log() call as a step exporter sees it: the step, the numbers under the keys exactly as
    written, the other values (as the file sink writes them) and the log() time."""

    step: int
    scalars: dict[str, int | float]
    others: dict[str, Any] = field(default_factory=dict)
    time_unix_nano: int = 0
    order: tuple[str, ...] | None = None  # the caller's key order, when numbers and others were mixed
    # For the file and console, which write numbers as the caller gave them (values.as_logged):
    as_logged: dict[str, Any] | None = None  # numpy scalars, ints beyond int64, by key
    step_as_logged: Any = None  # the step, when it was not a plain int (11.0, True)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One log() call as the sinks get it: a handful of objects instead of the ~800 of its
    ``MetricsData`` (a backlog of those in the queues made every full garbage collection, and so
    the training loop, pause longer).  Our step exporters take :meth:`record` directly; any other
    metric exporter gets :meth:`metrics_data`, built when it exports (in its queue thread, if queued)."""

    resource: Resource
    step: int
    scalars: Mapping[str, int | float]
    others: Mapping[str, Any]
    time_ns: int
    order: tuple[str, ...] | None = None  # the caller's key order, when numbers and others were mixed
    others_json: str | None = None  # ``others`` encoded (and so checked) by log()
    # What only the file and console sinks, which run in the training process, write (StepRecord's).
    as_logged: Mapping[str, Any] | None = None
    step_as_logged: Any = None

    def metrics_data(self) -> MetricsData:
        return step_batch(self.resource, self.step, self.scalars, self.others, self.time_ns, self.others_json)

    def record(self) -> StepRecord:
        """What a step exporter decodes from :meth:`metrics_data`, without building it (the other
        values take the same JSON round trip, so both paths write the same)."""
        others: dict[str, Any] = {}
        if self.others:
            others = decode_others(self.others_json if self.others_json is not None else encode_others(self.others))
        as_logged = dict(self.as_logged) if self.as_logged else None
        return StepRecord(
            self.step, dict(self.scalars), others, self.time_ns, self.order, as_logged, self.step_as_logged
        )


def step_batch_of(data: MetricsData) -> StepBatch | None:
    """The log() call that :func:`step_batch` made ``data`` from (what a spool record of it
    decodes to), so that a step exporter's bulk path takes it again; None for any other metric data
    (an OTLP sink's periodic gauges)."""
    if len(data.resource_metrics) != 1 or len(data.resource_metrics[0].scope_metrics) != 1:
        return None
    resource_metrics = data.resource_metrics[0]
    metrics = resource_metrics.scope_metrics[0].metrics
    points = []
    for metric in metrics:
        if not isinstance(metric.data, Gauge) or len(metric.data.data_points) != 1 or metric.description or metric.unit:
            return None
        points.append(metric.data.data_points[0])
    if not metrics or metrics[0].name != STEP_METRIC:
        return None
    step_point = points[0]
    # One log() call: its values have no attributes, and every point its time.
    if any(point.attributes or point.time_unix_nano != step_point.time_unix_nano for point in points[1:]):
        return None
    others_json = (step_point.attributes or {}).get(OTHERS_ATTRIBUTE)
    scalars = {metric.name: point.value for metric, point in zip(metrics[1:], points[1:], strict=True)}
    if len(scalars) != len(metrics) - 1:  # a key twice: not one log() call's
        return None
    return StepBatch(
        resource_metrics.resource,
        int(step_point.value),
        scalars,
        decode_others(str(others_json)) if others_json else {},
        step_point.time_unix_nano,
        others_json=str(others_json) if others_json else None,
    )


def materialize(data: MetricsData | StepBatch) -> MetricsData:
    return data.metrics_data() if isinstance(data, StepBatch) else data


class LatestValues:
    """Last value of every key (thread-safe), exported as cumulative-style gauges for OTLP."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, tuple[int | float, int]] = {}
        self._step: tuple[int, int] | None = None
        self._names = InstrumentNames()

    def update(self, step: int | None, scalars: Mapping[str, int | float], time_ns: int) -> None:
        """``step`` None: values only, the step gauge as it was."""
        with self._lock:
            if step is not None:
                self._step = (step, time_ns)
            values = self._values
            for key, value in scalars.items():
                values[key] = (value, time_ns)

    def snapshot(self, resource: Resource, extra: Sequence[Metric] = ()) -> MetricsData | None:
        """The latest values as gauges, and ``extra`` metrics (the open phases' ages)."""
        with self._lock:
            if self._step is None and not self._values and not extra:
                return None
            step_point = self._step
            items = list(self._values.items())
        metrics = []
        if step_point is not None:  # (values observed before any log() have no step yet)
            step, step_time = step_point
            metrics.append(_gauge(STEP_METRIC, step, step_time, description="training step of the last log() call"))
        for key, (value, time_ns) in items:
            name = self._names(key)
            metrics.append(_gauge(name, value, time_ns, description=key if name != key else None))
        return wrap(resource, [*metrics, *extra])


def labelled_gauge(
    name: str, unit: str, description: str, attribute: str, values: Mapping[str, float], time_ns: int
) -> Metric:
    """One gauge with a point per value of ``attribute`` (``values``: that value -> the gauge's)."""
    points = [
        NumberDataPoint(
            attributes={attribute: label}, start_time_unix_nano=time_ns, time_unix_nano=time_ns, value=value
        )
        for label, value in values.items()
    ]
    return Metric(name=name, description=description, unit=unit, data=Gauge(data_points=points))
