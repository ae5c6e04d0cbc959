"""The W3C carrier of a run's context, without the run: the identity and the step as baggage,
the environment carrier (``TRACEPARENT``/``BAGGAGE``) and reading a carrier back.  Below the
run and the settings (both use it); :mod:`otel_tracking.distributed.propagation` builds the public helpers
that need the current run on top of it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter

from otel_tracking.signals.semconv import IDENTITY_KEYS, STEP

# The OTel specification's environment-variable carrier: upper-case names of the W3C fields.
ENV_FIELDS = {"traceparent": "TRACEPARENT", "tracestate": "TRACESTATE", "baggage": "BAGGAGE"}


def with_identity(identity: Mapping[str, str], step: int | None, ctx: Context | None = None) -> Context:
    """``ctx`` (default: the current context) with the run identity and step as baggage."""
    for key, value in identity.items():
        if value and baggage.get_baggage(key, ctx) != value:
            ctx = baggage.set_baggage(key, value, ctx)
    if step is not None and baggage.get_baggage(STEP, ctx) != str(step):
        ctx = baggage.set_baggage(STEP, str(step), ctx)
    return ctx if ctx is not None else otel_context.get_current()


def identity_from(ctx: Context | None = None) -> dict[str, str]:
    """The run identity the context's baggage carries (empty when none)."""
    found = {key: baggage.get_baggage(key, ctx) for key in IDENTITY_KEYS}
    return {key: str(value) for key, value in found.items() if value}


def step_from(ctx: Context | None = None) -> int | None:
    raw = baggage.get_baggage(STEP, ctx)
    try:
        return int(str(raw)) if raw is not None else None
    except ValueError:
        return None


def has_span(ctx: Context | None = None) -> bool:
    return trace.get_current_span(ctx).get_span_context().is_valid


def extract(carrier: Mapping[str, Any]) -> Context:
    """The context a carrier holds (W3C ``traceparent``/``baggage``), on top of an empty one."""
    return propagate.extract(dict(carrier), context=Context())


class _EnvGetter(Getter[Mapping[str, str]]):
    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(ENV_FIELDS.get(key, key.upper()))
        return [value] if value is not None else None

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return [field for field, name in ENV_FIELDS.items() if name in carrier]


def extract_env(env: Mapping[str, str]) -> Context | None:
    """The context an environment carries (``TRACEPARENT``...), None when it carries none."""
    if ENV_FIELDS["traceparent"] not in env and ENV_FIELDS["baggage"] not in env:
        return None
    return propagate.extract(env, context=Context(), getter=_EnvGetter())
