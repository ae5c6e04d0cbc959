"""Carrying a run's trace context and identity to other processes.

The wire format is the W3C one every OpenTelemetry SDK speaks: ``traceparent`` (which span the
work belongs to) and ``baggage`` (the run identity ``ml.project``, ``ml.experiment``,
``ml.run.id`` and the step in progress, ``ml.step``).  Inside a ``trace_state`` span the standard
``opentelemetry.propagate.inject(carrier)`` already gives both; the helpers here add what people
need around it:

    carrier = inject()                     # a dict, from anywhere: outside any span it names the
                                           # driver's step span, so workers' spans join the step
    with attach(carrier): ...              # in the other process: continue that trace
    env = {**os.environ, **context_env()}  # a subprocess: TRACEPARENT / BAGGAGE, the OTel spec's
                                           # environment carrier, picked up by its first span

Ray actors and remote functions: :mod:`otel_tracking.ray_tracing`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter

IDENTITY_KEYS = ("ml.project", "ml.experiment", "ml.run.id", "ml.run.attempt")  # attempt: only when > 1
STEP_KEY = "ml.step"
# The OTel specification's environment-variable carrier: upper-case names of the W3C fields.
ENV_FIELDS = {"traceparent": "TRACEPARENT", "tracestate": "TRACESTATE", "baggage": "BAGGAGE"}


def with_identity(identity: Mapping[str, str], step: int | None, ctx: Context | None = None) -> Context:
    """``ctx`` (default: the current context) with the run identity and step as baggage."""
    for key, value in identity.items():
        if value and baggage.get_baggage(key, ctx) != value:
            ctx = baggage.set_baggage(key, value, ctx)
    if step is not None and baggage.get_baggage(STEP_KEY, ctx) != str(step):
        ctx = baggage.set_baggage(STEP_KEY, str(step), ctx)
    return ctx if ctx is not None else otel_context.get_current()


def identity_from(ctx: Context | None = None) -> dict[str, str]:
    """The run identity the context's baggage carries (empty when none)."""
    found = {key: baggage.get_baggage(key, ctx) for key in IDENTITY_KEYS}
    return {key: str(value) for key, value in found.items() if value}


def step_from(ctx: Context | None = None) -> int | None:
    raw = baggage.get_baggage(STEP_KEY, ctx)
    try:
        return int(str(raw)) if raw is not None else None
    except ValueError:
        return None


def has_span(ctx: Context | None = None) -> bool:
    return trace.get_current_span(ctx).get_span_context().is_valid


def current_context() -> Context:
    """The context to hand on: the current one, or, outside any span on the driver, the run's step
    span (so that work started between phases still joins the step's trace)."""
    from otel_tracking.run import current_run

    ctx = otel_context.get_current()
    if has_span(ctx):
        return ctx
    run = current_run()
    return run.parent_context(ctx) if run is not None else ctx


def inject(carrier: dict[str, str] | None = None) -> dict[str, str]:
    """The current trace context and run identity, written into ``carrier`` (a new dict by default)."""
    carrier = {} if carrier is None else carrier
    propagate.inject(carrier, current_context())
    return carrier


def extract(carrier: Mapping[str, Any]) -> Context:
    """The context a carrier holds (W3C ``traceparent``/``baggage``), on top of an empty one."""
    return propagate.extract(dict(carrier), context=Context())


@contextlib.contextmanager
def attach(carrier: Mapping[str, Any] | None) -> Iterator[Context]:
    """Continue the carrier's trace for the block (nothing changes for ``None`` or an empty carrier)."""
    if not carrier:
        yield otel_context.get_current()
        return
    ctx = extract(carrier)
    token = otel_context.attach(ctx)
    try:
        yield ctx
    finally:
        otel_context.detach(token)


def context_env(carrier: Mapping[str, str] | None = None) -> dict[str, str]:
    """``TRACEPARENT``/``TRACESTATE``/``BAGGAGE`` for a subprocess's environment (the current
    context unless a carrier is given); the child's first span outside any other continues it."""
    carrier = inject() if carrier is None else carrier
    return {ENV_FIELDS[key]: value for key, value in carrier.items() if key in ENV_FIELDS}


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
