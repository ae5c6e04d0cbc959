"""``trace_state``: a training phase as a span.

    with trace_state("rollout", state_lane_id=rank, model="actor"):
        ...

    @trace_state("update")
    def update(...): ...          # sync or async functions

The span nests under whatever span is current (OTel context lives in contextvars, so each thread
and each asyncio task has its own nesting), carries the lane as ``ml.lane`` and each label as
``ml.label.<name>``, and is recorded by the most recent unfinished run of this process; with no
run, by the global OpenTelemetry tracer (a no-op unless the app configured one).  The span's
``ml.step`` attribute is the step in progress: one more than the run's last logged step (phases
run before the ``log()`` that closes their step), or the ``step=`` label when one is given.  An exception
inside the block marks the span as an error and propagates.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Span

from otel_tracking.redact import REDACTED, is_secret_key
from otel_tracking.values import to_step

LANE_ATTRIBUTE = "ml.lane"
LABEL_PREFIX = "ml.label."
STEP_ATTRIBUTE = "ml.step"

F = TypeVar("F", bound=Callable[..., Any])


def _attribute_value(value: Any) -> Any:
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float)) for v in value):
        return list(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:
        try:
            return _attribute_value(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def state_attributes(state_lane_id: Any, labels: dict[str, Any]) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    if state_lane_id is not None:
        attributes[LANE_ATTRIBUTE] = _attribute_value(state_lane_id)
    for name, value in labels.items():
        attributes[LABEL_PREFIX + name] = REDACTED if is_secret_key(name) else _attribute_value(value)
    return attributes


class trace_state:
    def __init__(self, state_name: str, state_lane_id: str | int | None = None, **labels: Any) -> None:
        if not isinstance(state_name, str) or not state_name:
            raise ValueError(f"trace_state needs a non-empty state name, got {state_name!r}")
        self.state_name = state_name
        step = labels.pop("step", None)
        self.attributes = state_attributes(state_lane_id, labels)
        if step is not None:
            self.attributes[STEP_ATTRIBUTE] = to_step(step)
        self._managers: list[Any] = []

    def _start(self) -> Span:
        from otel_tracking.run import current_run

        run = current_run()
        attributes = self.attributes
        if run is not None and STEP_ATTRIBUTE not in attributes:
            # The step in progress: phases run before the log() call that closes their step.
            attributes = {**attributes, STEP_ATTRIBUTE: 0 if run.last_step is None else run.last_step + 1}
        tracer = run.tracer if run is not None else trace.get_tracer("otel_tracking")
        manager = tracer.start_as_current_span(self.state_name, attributes=attributes)
        # One trace_state object may be entered again while open (recursion, decorator reuse):
        # keep a stack of the context managers it opened.
        self._managers.append(manager)
        return manager.__enter__()

    def _end(self, exc_type: Any, exc: Any, tb: Any) -> None:
        manager = self._managers.pop()
        manager.__exit__(exc_type, exc, tb)

    def __enter__(self) -> Span:
        return self._start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._end(exc_type, exc, tb)

    async def __aenter__(self) -> Span:
        return self._start()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._end(exc_type, exc, tb)

    def __call__(self, func: F) -> F:
        """As a decorator: a fresh span for every call, for plain and async functions."""
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with self._fresh():
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def _fresh(self) -> trace_state:
        # Each call gets its own object: calls may overlap in threads and tasks.
        state = trace_state(self.state_name)
        state.attributes = self.attributes
        return state
