"""Reading the local stack back in tests: Jaeger's HTTP query API and Prometheus's instant queries,
for any object with ``jaeger_url`` and ``prometheus_url`` (``otel_tracking_stack.stack.Stack``)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5.0) as response:  # an HTTP error status raises
        return json.loads(response.read())


def jaeger_services(stack: Any) -> list[str]:
    return list(_get_json(f"{stack.jaeger_url}/api/services").get("data") or [])


def jaeger_traces(
    stack: Any, service: str, limit: int = 100, lookback: str = "1h", **params: str
) -> list[dict[str, Any]]:
    """Traces of ``service`` from Jaeger's HTTP query API (``/api/traces``), newest first."""
    query = {"service": service, "limit": str(limit), "lookback": lookback, **params}
    return list(_get_json(f"{stack.jaeger_url}/api/traces?{urllib.parse.urlencode(query)}").get("data") or [])


def prom_query(stack: Any, expr: str, time_: float | None = None) -> list[dict[str, Any]]:
    """Instant query against Prometheus (``/api/v1/query``); the ``result`` list."""
    params = {"query": expr}
    if time_ is not None:
        params["time"] = str(time_)
    data = _get_json(f"{stack.prometheus_url}/api/v1/query?{urllib.parse.urlencode(params)}")
    if data.get("status") != "success":
        raise AssertionError(f"query {expr!r} failed: {data}")
    return list(data["data"]["result"])


def prom_alerts(stack: Any) -> list[dict[str, Any]]:
    """The alerts Prometheus holds now, pending or firing (``/api/v1/alerts``)."""
    data = _get_json(f"{stack.prometheus_url}/api/v1/alerts")
    return list(data["data"]["alerts"])
