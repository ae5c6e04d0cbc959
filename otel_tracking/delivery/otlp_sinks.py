"""The OTLP sinks: the SDK's OTLP exporters for the signals the settings turn on.

The exporters read endpoint, headers and TLS from the standard ``OTEL_EXPORTER_OTLP_*`` variables
themselves.  Here: which URL each signal goes to (:func:`otlp_endpoint`, for the spool header,
so that replay sends to the same endpoint), one try per export (the sink's queue retries, not the
exporter), a CA file that wins over ``REQUESTS_CA_BUNDLE``, and one warning at start when nothing
listens at the endpoint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from otel_tracking.compat.otlp_failures import explain_failures
from otel_tracking.config.settings import Settings, describe_otlp
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.registry import SIGNAL_PART
from otel_tracking.exporters._base import SinkParts
from otel_tracking.signals.redact import scrub_text

logger = logging.getLogger("otel_tracking")

_OTLP_SIGNALS = {"metrics": "METRICS", "traces": "TRACES", "logs": "LOGS"}


def otlp_endpoint(signal: str, protocol: str, env: Mapping[str, str]) -> tuple[str, bool]:
    """The URL the SDK's exporter for ``signal`` sends to, by the standard variables' rules, and
    whether a variable set it (False: the SDK's default)."""
    own = env.get(f"OTEL_EXPORTER_OTLP_{_OTLP_SIGNALS[signal]}_ENDPOINT")
    if own:
        return own, True
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == "grpc":
        return base or "http://localhost:4317", bool(base)
    root = base or "http://localhost:4318"
    return f"{root if root.endswith('/') else root + '/'}v1/{signal}", bool(base)


def build_otlp_sinks(settings: Settings, remembered: Mapping[str, str] | None = None) -> dict[str, Sink]:
    """OTLP exporters for the signals the settings turn on; they read endpoint, headers and TLS
    from the standard OTEL_EXPORTER_OTLP_* variables themselves.  ``remembered`` (replay: signal
    -> the endpoint a spool header names) is used for a signal whose endpoint no variable sets."""
    otlp = settings.otlp
    if not otlp.any:
        return {}
    from otel_tracking.compat.otel_sdk import one_try_per_export, otlp_log_exporter_class

    OTLPLogExporter = otlp_log_exporter_class(otlp.protocol)
    if otlp.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
            OTLPMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]

    if otlp.protocol != "grpc":
        # requests imports netrc on a session's first request, on our queue thread: a fork() in
        # the middle of that import leaves the module's import lock held in the child, whose own
        # exports then hang on it forever.  Import it now, before any worker runs.
        import netrc  # noqa: F401

    where = describe_otlp(settings)
    _warn_if_unreachable(otlp.endpoint)
    # Over HTTP, a CA file from OTEL_EXPORTER_OTLP_CERTIFICATE must win over REQUESTS_CA_BUNDLE,
    # which requests would otherwise let override the exporter's own setting.
    args: dict[str, Any] = {"session": _certificate_session()} if otlp.certificate and otlp.protocol != "grpc" else {}
    exporters = {"metrics": OTLPMetricExporter, "traces": OTLPSpanExporter, "logs": OTLPLogExporter}
    sinks: dict[str, Sink] = {}
    for signal in (s for s in ("metrics", "traces", "logs") if getattr(otlp, s)):
        endpoint, from_env = otlp_endpoint(signal, otlp.protocol, os.environ)
        signal_args, signal_where = args, where
        if not from_env and remembered and remembered.get(signal):
            endpoint = remembered[signal]
            signal_args = {**args, "endpoint": endpoint}
            signal_where = f"OTLP {otlp.protocol} -> {endpoint} (the run's endpoint, kept in its spool)"
        parts = SinkParts(
            **{SIGNAL_PART[signal]: explain_failures(one_try_per_export(exporters[signal](**signal_args)))},
            where=signal_where,
            # In the spool header: replay sends to the same endpoint unless a variable says
            # otherwise (not one with credentials in it: those stay off the disk).
            resume={"endpoint": endpoint if scrub_text(endpoint) == endpoint else None, "protocol": otlp.protocol},
        )
        sinks[signal] = Sink(f"otlp-{signal}", parts)
    return sinks


def _certificate_session() -> Any:
    import requests

    class CertificateSession(requests.Session):
        def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
            merged = super().merge_environment_settings(url, proxies, stream, verify, cert)
            # The exporter's CA file (OTEL_EXPORTER_OTLP_CERTIFICATE): the session's `verify` since the
            # SDK's HTTP transport (1.45), the request's own `verify` argument before it.
            merged["verify"] = self.verify if verify is None else verify
            return merged

    return CertificateSession()


def _warn_if_unreachable(endpoint: str | None) -> None:
    """One clear line at construction when nothing listens at the OTLP endpoint (a 0.2 s TCP
    connect).  Not an error: the collector may come up later, and until then the data waits."""
    import socket
    from urllib.parse import urlsplit

    if not endpoint:
        return
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 4318)
    try:
        with socket.create_connection((parts.hostname or "localhost", port), timeout=0.2):
            return
    except OSError as error:
        logger.warning(
            "otel-tracking: the OTLP endpoint %s is not reachable now (%s); telemetry for it is retried and "
            "spooled until it is (see `otel-tracking replay`)",
            endpoint,
            error.strerror or type(error).__name__,
        )
