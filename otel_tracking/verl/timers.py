"""``verl.utils.profiler.performance._timer``: every ``marked_timer`` opens a span named after its key.

verl has three ``marked_timer`` implementations (performance, nvtx, mstx), chosen at import; all
three, and ``simple_timer``, ``yield from`` the module-level ``_timer`` at call time, so replacing
that one function reaches every call site.  The span is a ``trace_state`` named after the timing
key: on the driver it hangs under the step's root (or the enclosing phase), so ``timing_s/<name>``
in the trackers and the span ``<name>`` in Jaeger are the same phase.

``simple_timer`` runs once per sample in the agent loops; it opens spans only with
``OTEL_TRACKING_VERL_SIMPLE_TIMER=1``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from otel_tracking.compat import verl_internals
from otel_tracking.verl import switch
from otel_tracking.verl.guard import cannot_patch, quietly

_PATCHED = "__otel_tracking_patched__"


def patch(performance: ModuleType) -> None:
    verl_timer = verl_internals.performance_timer(performance)
    if verl_timer is None:
        cannot_patch(performance.__name__, ["_timer"])
        return
    if getattr(verl_timer, _PATCHED, False):
        return
    simple = getattr(performance, "simple_timer", None)
    simple_code = getattr(getattr(simple, "__wrapped__", simple), "__code__", None)
    simple_spans = switch.simple_timer_spans()

    def _timer(name: str, timing_raw: dict[str, float]) -> Iterator[None]:
        # A plain function (not a generator) so that the caller is the frame below: simple_timer's
        # calls cost one comparison when they open no span.
        if not simple_spans and sys._getframe(1).f_code is simple_code:
            return verl_timer(name, timing_raw)  # type: ignore[no-any-return]
        return _spanned(verl_timer, name, timing_raw)

    _timer.__doc__ = verl_timer.__doc__
    from otel_tracking.runtime import anatomy

    anatomy.measure_by_default()  # the phases are verl's: each step's anatomy says where it went
    setattr(_timer, _PATCHED, True)
    performance.verl_timer = verl_timer  # type: ignore[attr-defined]
    verl_internals.replace_performance_timer(performance, _timer)


def _open(name: Any) -> Any:
    from otel_tracking.api.spans import trace_state

    state = trace_state(str(name))
    state.__enter__()
    return state


def _close(state: Any, exc: BaseException | None) -> None:
    if state is not None:
        state.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)


def _spanned(verl_timer: Any, name: str, timing_raw: dict[str, float]) -> Iterator[None]:
    state = quietly("marked_timer span", _open, name)
    try:
        yield from verl_timer(name, timing_raw)
    except BaseException as exc:
        quietly("marked_timer span", _close, state, exc)
        raise
    quietly("marked_timer span", _close, state, None)
