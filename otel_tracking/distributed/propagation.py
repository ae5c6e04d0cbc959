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

Ray actors and remote functions: :mod:`otel_tracking.distributed.ray_tracing`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.context import Context

from otel_tracking.runtime.run import current_run
from otel_tracking.signals.carrier import ENV_FIELDS, extract, has_span


def current_context() -> Context:
    """The context to hand on: the current one, or, outside any span on the driver, the run's step
    span (so that work started between phases still joins the step's trace)."""
    ctx = otel_context.get_current()
    if has_span(ctx):
        return ctx
    run = current_run()
    return run.parent_context(ctx) if run is not None else ctx


def inject(carrier: dict[str, str] | None = None) -> dict[str, str]:
    """The current trace context and run identity, written into ``carrier`` (a new dict by default)."""
    carrier = {} if carrier is None else carrier
    ctx = current_context()
    run = current_run()
    if run is not None:  # the trace it names keeps its id from now on (runtime/step_roots.py)
        ctx = run.context_to_carry(ctx)
    propagate.inject(carrier, ctx)
    return carrier


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
