"""A link to the run's traces in a trace UI, for the end-of-run summary and the demo.

``OTEL_TRACKING_TRACES_URL`` is the UI's base URL; ``otel-tracking stack up`` prints it for the
stack's Zipkin (``http://127.0.0.1:9411/zipkin/``).  The link is Zipkin's search page for the
run's service with the run's id (``ml.run.id``, a resource attribute, which the stack's relay
turns into a tag on every span): one row per trace, a step's root with its phases under it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping

from otel_tracking.signals import semconv

VARIABLE = "OTEL_TRACKING_TRACES_URL"
_LIMIT = "1000"  # traces listed: one per step (Zipkin keeps no more than its memory store holds)
_MARGIN_MS = 60_000  # around the run's time range: clocks of other hosts, spans that end late


def check_traces_url(env: Mapping[str, str]) -> str | None:
    """The base URL from the environment, or None; ``ValueError`` naming the variable when it is
    not an http(s) URL with a host."""
    raw = env.get(VARIABLE, "").strip()
    if not raw:
        return None
    parts = urllib.parse.urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{VARIABLE}={raw!r} is not an http(s) URL of a trace UI (e.g. http://127.0.0.1:9411/zipkin/)")
    if parts.username or parts.password:
        raise ValueError(f"{VARIABLE} must not carry credentials: the link is printed for anyone to read")
    return raw


def traces_link(base: str, service_name: str, run_id: str, started_ns: int, ended_ns: int) -> str:
    """The trace UI's search page for the run's traces, between its start and its end: Zipkin's
    page runs the search when it opens, as it does when the time range and a limit are in the
    address (Zipkin lowercases service names)."""
    query = urllib.parse.urlencode(
        {
            "serviceName": service_name.lower(),
            "annotationQuery": f"{semconv.RUN_ID}={run_id}",
            "lookback": "range",
            "startTs": str(started_ns // 1_000_000 - _MARGIN_MS),
            "endTs": str(ended_ns // 1_000_000 + _MARGIN_MS),
            "limit": _LIMIT,
        }
    )
    return f"{base.split('?', 1)[0].rstrip('/')}/?{query}"
