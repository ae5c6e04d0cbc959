"""The carrier of every instrumented call, made and read once per context instead of once per call.

W3C baggage is most of a carrier's cost: writing it quotes every entry, reading it back validates
and unquotes them (``bench/bench_verl.py --parts micro`` measures a call).  A worker-group call
sends one carrier per worker, and verl calls from inside a ``marked_timer`` phase, whose context
does not change between calls: the driver makes the carrier once per context, and each worker
reads each distinct carrier once.  Contexts are immutable, so both are safe to reuse.
"""

from __future__ import annotations

import threading
from typing import Any

_last: tuple[Any, dict[str, str]] | None = None  # (the context it was made in, the carrier)
_contexts: dict[tuple[Any, ...], Any] = {}
_CONTEXTS_KEPT = 256  # distinct carriers a worker keeps read (one per phase and step in practice)
_lock = threading.Lock()


def current_carrier() -> dict[str, str]:
    """``otel_tracking.distributed.propagation.inject()``, made once per current context when a
    span is current (outside any span it names the step's root, which moves on with the steps).
    Callers must not change it."""
    global _last
    from opentelemetry import context

    ctx = context.get_current()
    last = _last
    if last is not None and last[0] is ctx:  # holding ``ctx``: its id cannot be reused meanwhile
        return last[1]
    from otel_tracking.distributed.propagation import inject
    from otel_tracking.signals.carrier import has_span

    carrier = inject()
    if has_span(ctx):
        _last = (ctx, carrier)
    return carrier


def context_of(carrier: Any) -> Any:
    """The context a carrier holds (``otel_tracking.signals.carrier.extract``), read once."""
    from otel_tracking.signals.carrier import extract

    try:
        key = tuple(carrier.items())
        found = _contexts.get(key)
    except (AttributeError, TypeError):  # not a mapping of hashable values: read it, keep nothing
        return extract(carrier)
    if found is None:
        found = extract(carrier)
        with _lock:
            if len(_contexts) >= _CONTEXTS_KEPT:
                _contexts.clear()
            _contexts[key] = found
    return found
