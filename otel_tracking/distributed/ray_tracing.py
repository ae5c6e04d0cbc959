"""Trace context and run identity across Ray actors and remote functions.

Ray carries no OpenTelemetry context into the processes it calls, and its own tracing hook is
alpha (it injects ``_ray_trace_ctx`` into every call and breaks generator methods), so we do not
use it.  Instead, three small pieces, none of which imports ``ray``:

    @ray.remote
    @traced                                   # every method takes the caller's context
    class Worker:
        def update(self, batch): ...          # sync, async, generator and async generator methods

    worker = Worker.options(runtime_env=runtime_env()).remote()   # OTLP settings + run identity
    ray.get(with_context(worker).update.remote(batch))            # the caller's context goes along

``traced`` adds one keyword-only parameter, ``_otel_context`` (a W3C carrier dict), to the
function's signature (``__signature__``, which Ray checks calls against; the wrapper keeps no
``__wrapped__``, since Ray unwraps before reading signatures).  ``with_context`` fills it with the
caller's context (:func:`otel_tracking.distributed.propagation.inject`: the current span, or the driver's
step span) for ``.remote()`` calls on a handle, a method or a remote function, from any process.
Inside the call, ``trace_state`` spans hang under the caller's span and carry its run identity,
and the call returns only once they have left the process (Ray ends its workers with ``_exit``,
see :mod:`otel_tracking.distributed.worker`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from otel_tracking.distributed.propagation import attach, inject

CARRIER_KWARG = "_otel_context"

logger = logging.getLogger("otel_tracking")

T = TypeVar("T")


def traced(target: T) -> T:
    """Carry the caller's trace context into a function, or into every method of a class (an actor
    class, before ``@ray.remote``).  Calls without a context work as before."""
    if inspect.isclass(target):
        for name, member in list(vars(target).items()):
            if name.startswith("__") and name != "__call__":
                continue
            if isinstance(member, (staticmethod, classmethod)):
                setattr(target, name, type(member)(_wrap(member.__func__, method=False)))
            elif inspect.isfunction(member):
                setattr(target, name, _wrap(member, method=True))
        return target
    if not callable(target):
        raise TypeError(f"traced() takes a function or a class, got {target!r}")
    return _wrap(target, method=False)  # type: ignore[arg-type, return-value]


def _wrap(func: Callable[..., Any], method: bool) -> Callable[..., Any]:
    signature = inspect.signature(func)
    if CARRIER_KWARG in signature.parameters:
        return func  # traced already

    def enter(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method and args:
            from otel_tracking.distributed.worker import actor_defaults

            actor_defaults(args[0])  # ml.role and ml.rank of this worker, unless configured
        return attach(kwargs.pop(CARRIER_KWARG, None))

    # Ray may end this process with _exit as soon as its caller has the result, running no Python
    # code first (see distributed/worker.py): each wrapper returns (or raises, or ends its stream) only after
    # the spans of the call have left, unless its caller will ask for them first (drain.py).
    wrapper: Callable[..., Any]
    if inspect.isasyncgenfunction(func):

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                with enter(args, kwargs):
                    async for item in func(*args, **kwargs):
                        yield item
            finally:
                await _delivered_async()

    elif inspect.isgeneratorfunction(func):

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                with enter(args, kwargs):
                    yield from func(*args, **kwargs)
            finally:
                _delivered()

    elif inspect.iscoroutinefunction(func):

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                with enter(args, kwargs):
                    return await func(*args, **kwargs)
            finally:
                await _delivered_async()

    else:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                with enter(args, kwargs):
                    return func(*args, **kwargs)
            finally:
                _delivered()

    functools.update_wrapper(wrapper, func)
    del wrapper.__wrapped__  # type: ignore[union-attr]  # Ray reads the signature after inspect.unwrap
    wrapper.__signature__ = _with_carrier(signature)  # type: ignore[union-attr]
    return wrapper


def _delivered() -> None:
    from otel_tracking.distributed.drain import at_call_end

    try:
        at_call_end()
    except Exception:  # telemetry never changes what a call returns or raises
        logger.exception("otel-tracking: waiting for a call's spans failed")


async def _delivered_async() -> None:
    from otel_tracking.distributed.drain import at_call_end_async

    try:
        await at_call_end_async()
    except Exception:
        logger.exception("otel-tracking: waiting for a call's spans failed")


def _with_carrier(signature: inspect.Signature) -> inspect.Signature:
    parameters = list(signature.parameters.values())
    carrier = inspect.Parameter(CARRIER_KWARG, inspect.Parameter.KEYWORD_ONLY, default=None)
    at = len(parameters)
    if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD:
        at -= 1  # keyword-only parameters come before **kwargs
    return signature.replace(parameters=[*parameters[:at], carrier, *parameters[at:]])


class _WithContext:
    """``.remote()`` / ``.options()`` of a Ray method or remote function, adding the caller's context
    (and, for an actor's method, covering the actor: :mod:`otel_tracking.distributed.drain`)."""

    def __init__(self, target: Any, handle: Any = None) -> None:
        self._target = target
        self._handle = handle

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault(CARRIER_KWARG, inject())
        if self._handle is not None:
            _remember(self._handle)
        return self._target.remote(*args, **kwargs)

    def options(self, **options: Any) -> _WithContext:
        return _WithContext(self._target.options(**options), self._handle)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        # An actor handle: its methods are what get called.
        return _WithContext(attribute, self._target) if hasattr(attribute, "remote") else attribute


def _remember(handle: Any) -> None:
    from otel_tracking.distributed.drain import remember

    try:
        remember(handle)
    except Exception:  # a call goes out whatever happened here
        logger.exception("otel-tracking: covering an actor failed")


def with_context(target: Any) -> Any:
    """A Ray actor handle, actor method or remote function whose ``.remote()`` calls carry the
    caller's trace context (to a ``traced`` callee)."""
    return _WithContext(target)


def runtime_env(
    base: Mapping[str, Any] | None = None, *, tracking: Any = None, headers: bool = False
) -> dict[str, Any]:
    """A Ray ``runtime_env`` that gives actors this process's OTel and otel-tracking settings and
    the run identity (of ``tracking``, else of the current run), merged under ``base``'s own
    ``env_vars``.  OTLP header variables (credentials) are passed only with ``headers=True``: a
    node-local agent (``deploy/``) needs none, and Ray shows runtime environments in its dashboard."""
    from otel_tracking.distributed.environment import propagated_env
    from otel_tracking.runtime.run import current_run

    run = tracking._run if tracking is not None else current_run()
    identity = dict(run.identity) if run is not None else {}
    merged = dict(base or {})
    merged["env_vars"] = {**propagated_env(identity, headers=headers), **dict(merged.get("env_vars") or {})}
    return merged
