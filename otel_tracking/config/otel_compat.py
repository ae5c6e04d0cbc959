"""Every OpenTelemetry name that has no public home, imported in this one place.

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
"""

from __future__ import annotations

from typing import Any

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
    "otlp_log_exporter_class",
    "sdk_gauge_class",
]


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
