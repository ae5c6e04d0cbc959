"""Every OpenTelemetry name that has no public home, imported in this one place (but for the OTLP
exporters' internals ``otlp_failures.py`` reads to say why an export failed).

Supported: ``opentelemetry-sdk`` (and api, exporter-otlp) from 1.39 up to, not including, 2.0;
``scripts/test`` runs the core tests on the oldest (the floor in ``pyproject.toml``) and the newest.

- Logs. The Python logs signal is still experimental: its API and SDK live only in
  ``opentelemetry._logs`` and ``opentelemetry.sdk._logs`` (and the OTLP log exporters in
  ``..._log_exporter`` modules). There is no public equivalent. The SDK's log data model changed
  in 1.39 (``LogData``/``LogExporter``/``LogExportResult`` became ``ReadableLogRecord``,
  ``ReadWriteLogRecord``, ``LogRecordExporter``/``LogRecordExportResult``): that is why 1.39 is the
  oldest release we support. Older ones fail here, with a message that says so.
- The synchronous ``Gauge`` instrument class of the SDK (for a preferred temporality): exported as
  ``opentelemetry.sdk.metrics._Gauge`` (listed in its ``__all__``) while the API's gauge is
  experimental; ``sdk_gauge_class`` also takes a public ``Gauge`` when a release exports one, and
  the ``_internal`` module only as the last resort.
- The OTLP exporters' own retry loop (``one_try_per_export``) and the providers' reading of
  ``OTEL_SDK_DISABLED`` (``enabled_despite_sdk_disabled``): per-instance attributes the SDK has no
  public setting for.
- A span's attributes as items (``span_attribute_items``): the dict under the SDK's
  ``BoundedAttributes``, whose public mapping is iterated attribute by attribute in Python; the
  public mapping when a release has no such dict.  Whether a span has events or links
  (``span_has_events_or_links``): the SDK's ``BoundedList`` under ``events`` and ``links``, whose
  public properties copy each list under its lock into a new tuple at every read.
- The periodic reader's collect hook (``periodic_reader``): the SDK's reader exports what a
  MeterProvider collects; ours reads the latest logged values instead, which a MeterProvider would
  make the hot path pay for, value by value.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricsData, PeriodicExportingMetricReader

try:
    from opentelemetry._logs import LogRecord, SeverityNumber
    from opentelemetry.sdk._logs import LoggerProvider, LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord
    from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
except ImportError as error:  # an SDK older than pyproject.toml allows
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("opentelemetry-sdk")
    except PackageNotFoundError:
        found = "none"
    raise ImportError(
        f"otel-tracking needs opentelemetry-sdk>=1.39 (its ReadableLogRecord/LogRecordExporter logs API); "
        f"installed: {found} ({error})"
    ) from error

__all__ = [
    "LogRecord",
    "LogRecordExportResult",
    "LogRecordExporter",
    "LogRecordProcessor",
    "LoggerProvider",
    "ReadWriteLogRecord",
    "ReadableLogRecord",
    "SeverityNumber",
    "enabled_despite_sdk_disabled",
    "one_try_per_export",
    "otlp_log_exporter_class",
    "periodic_reader",
    "sdk_gauge_class",
    "span_attribute_items",
    "span_has_events_or_links",
]


def span_attribute_items(span: Any) -> tuple[tuple[str, Any], ...]:
    """An ended span's attributes, as a tuple of (key, value) items in their order."""
    raw = getattr(getattr(span, "_attributes", None), "_dict", None)
    if type(raw) is dict:
        return tuple(raw.items())
    return tuple((span.attributes or {}).items())


def span_has_events_or_links(span: Any) -> bool:
    """Whether an ended span has an event or a link (without copying them, as ``span.events`` and
    ``span.links`` do)."""
    events, links = getattr(span, "_events", None), getattr(span, "_links", None)
    if events is None or links is None:
        return bool(span.events or span.links)
    return bool(len(events) or len(links))


def sdk_gauge_class() -> type:
    """The SDK's synchronous Gauge instrument class, the key a reader's ``preferred_temporality``
    takes for ``meter.create_gauge`` instruments."""
    from opentelemetry.sdk import metrics

    for name in ("Gauge", "_Gauge"):  # public once the API's gauge is stable; exported as _Gauge until then
        cls = getattr(metrics, name, None)
        if isinstance(cls, type):
            return cls
    from opentelemetry.sdk.metrics._internal.instrument import Gauge  # the class both names refer to

    return Gauge


def otlp_log_exporter_class(protocol: str) -> Any:
    """``OTLPLogExporter`` for ``grpc`` or ``http/protobuf`` (modules named ``_log_exporter``)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    else:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter  # type: ignore[assignment]
    return OTLPLogExporter


_T = TypeVar("_T")


def one_try_per_export(exporter: _T) -> _T:
    """Turn off the SDK exporter's own retry loop: our delivery worker already retries (with
    OTEL_TRACKING_MAX_ATTEMPTS and its backoff, then spools), and the SDK's loop inside each of our
    attempts (up to 6 tries with 1, 2, 4 ... s pauses within OTEL_EXPORTER_OTLP_TIMEOUT) made a
    run's finish() against a dead endpoint take ~30 s and print a dozen "Transient error" lines.
    Each export is now one request (plus the SDK's immediate reconnect of a stale pooled
    connection), bounded by OTEL_EXPORTER_OTLP_TIMEOUT (over HTTP the whole of it, however long
    the batch took to serialize).

    The SDK has no public setting for this; these are the per-instance hooks it has (checked by
    tests/test_otlp.py on the newest SDK and on the oldest we support, which fails if a release
    moves them).  An exporter without them keeps its own loop: slower to give up, nothing lost."""
    client = getattr(exporter, "_client", None)
    if callable(getattr(client, "_compute_backoff", None)):  # OTLP/HTTP, SDK 1.45+: a pause past any deadline
        client._compute_backoff = lambda retry: math.inf  # type: ignore[union-attr]
        _whole_timeout_per_request(client, "_submit", getattr(client, "_timeout", None))
        return exporter
    if isinstance(getattr(exporter, "_retryable_error_codes", None), frozenset):  # OTLP/gRPC, 1.45+
        exporter._retryable_error_codes = frozenset()  # type: ignore[attr-defined]
        return exporter
    _whole_timeout_per_request(exporter, "_export", getattr(exporter, "_timeout", None))  # OTLP/HTTP before 1.45
    # Older SDKs: the pause before a retry waits on this event, which ends the loop when set (it
    # logs "aborting retry" once an attempt).  The exporter's own shutdown flag is another one.
    for name in ("_shutdown_in_progress", "_shutdown_is_occuring"):
        event = getattr(exporter, name, None)
        if isinstance(event, threading.Event):
            event.set()
            break
    return exporter


def _whole_timeout_per_request(owner: Any, name: str, timeout_s: Any) -> None:
    """The SDK's OTLP/HTTP exporter hands its request ``owner.<name>(data, timeout)`` what is left
    of the export's deadline, taken before the batch was serialized and compressed: a thread
    starved for longer than the timeout in between (a rank's process on an overloaded node) handed
    it 0.0, which requests refuses ("Attempted to set connect timeout to 0.0") and the export
    failed unsent.  With one request per export, that request gets the whole timeout."""
    send = getattr(owner, name, None)
    if not callable(send) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        return
    try:
        if len(inspect.signature(send).parameters) < 2:  # not (data, timeout): the gRPC exporter's
            return
    except (TypeError, ValueError):
        return

    def send_with_the_whole_timeout(data: Any, timeout: Any = None) -> Any:
        return send(data, timeout_s if timeout is None else max(timeout, timeout_s))

    setattr(owner, name, send_with_the_whole_timeout)


def enabled_despite_sdk_disabled(provider: _T) -> _T:
    """A TracerProvider or LoggerProvider that hands out recording tracers and loggers even under
    ``OTEL_SDK_DISABLED`` (which the SDK's constructors read into ``_disabled``)."""
    if getattr(provider, "_disabled", False):
        provider._disabled = False  # type: ignore[attr-defined]
    return provider


def periodic_reader(
    exporter: MetricExporter, collect: Callable[[], MetricsData | None], interval_s: float
) -> PeriodicExportingMetricReader:
    """The SDK's periodic reader (its thread, interval, one last export at ``shutdown()``, restart
    after a fork) exporting what ``collect()`` returns, with no MeterProvider: it sets the hook a
    provider sets when the reader is registered (``_set_collect_callback``, internal to the SDK)."""
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_s * 1000)

    def collect_for(_reader: Any, timeout_millis: Any = None) -> Any:  # a provider's hook takes both
        return collect()

    reader._set_collect_callback(collect_for)
    return reader
