"""``verl.utils.tracking``: verl's facade becomes ours, and verl's ``RLInsightLogger`` records.

The three classes are replaced in the module right after it loads, before any trainer binds them
(at import, like the v1 trainer, or inside ``fit()``, like the legacy one); a verl module that
bound them earlier gets ours too.  ``RLInsightLogger`` stays verl's class, called as it always is
(``RLInsightLogger.trace_state(...)`` through the class object), with three methods patched on it:

* ``trace_state``: our span (``otel_tracking.api.spans.trace_state``), in every process, whatever
  ``VERL_RL_INSIGHT_ENABLE`` says; when rl_insight is enabled too, verl's own goes on inside it;
* ``log``: the values as gauges on the OTLP path of this process's run (the ML trackers get the
  values through ``Tracking``), then verl's;
* ``register_metrics`` (which ``register_rollout_metrics`` and ``register_transfer_queue_metrics``
  call): the scrape targets recorded as ours are (``otel_tracking.distributed.targets``), then verl's.

Each wrapper takes ``*args, **kwargs`` and hands them to verl's method untouched; what it needs of
them it reads by the names of that method's own signature (``_arguments``), so a verl whose
methods take one more keyword, take ``state_lane_id`` by position or order their optional
arguments differently is called as it expects, and our side still finds each argument.
"""

from __future__ import annotations

import functools
import inspect
import sys
from contextlib import ContextDecorator
from types import ModuleType
from typing import Any

from otel_tracking.verl.guard import cannot_patch, quietly

FACADE = ("Tracking", "ValidationGenerationsLogger", "DapoFilteredRewardTableLogger")
RL_INSIGHT_METHODS = ("trace_state", "log", "register_metrics")
_PATCHED = "__otel_tracking_patched__"


def patch(module: ModuleType) -> None:
    if getattr(module, _PATCHED, False):
        return
    setattr(module, _PATCHED, True)
    import otel_tracking.api.facade
    import otel_tracking.api.generations

    ours = {
        "Tracking": otel_tracking.api.facade.Tracking,
        "ValidationGenerationsLogger": otel_tracking.api.generations.ValidationGenerationsLogger,
        "DapoFilteredRewardTableLogger": otel_tracking.api.generations.DapoFilteredRewardTableLogger,
    }
    missing = []
    for name in FACADE:
        theirs = getattr(module, name, None)
        if theirs is None:
            missing.append(name)
            continue
        setattr(module, f"verl_{name}", theirs)  # verl's own, for whoever needs it
        setattr(module, name, ours[name])
        _rebind(theirs, ours[name])
    insight = getattr(module, "RLInsightLogger", None)
    if insight is None:
        missing.append("RLInsightLogger")
    else:
        missing.extend(f"RLInsightLogger.{name}" for name in patch_rl_insight(insight))
    cannot_patch(module.__name__, missing)


def _rebind(theirs: object, ours: object) -> None:
    """verl modules that imported the name before we were installed (``worker_setup`` in a process
    that had imported verl already) see ours too."""
    for name, loaded in list(sys.modules.items()):
        if loaded is None or not (name == "verl" or name.startswith("verl.")):
            continue
        for attribute, value in list(vars(loaded).items()):
            if value is theirs and not attribute.startswith("verl_"):
                setattr(loaded, attribute, ours)


def patch_rl_insight(cls: type) -> list[str]:
    """Patch the three methods on verl's class; returns the names it does not have."""
    missing = [name for name in RL_INSIGHT_METHODS if not callable(getattr(cls, name, None))]
    if "trace_state" not in missing:
        cls.trace_state = _trace_state(cls.trace_state)  # type: ignore[attr-defined]
    if "log" not in missing:
        cls.log = _log(cls.log)  # type: ignore[attr-defined]
    if "register_metrics" not in missing:
        cls.register_metrics = _register_metrics(cls.register_metrics)  # type: ignore[attr-defined]
    return missing


def _verl_enabled(cls: Any) -> bool:
    return bool(quietly("RLInsightLogger.enabled", cls.enabled, default=False))


def _open_span(state_name: Any, state_lane_id: Any, labels: dict[str, Any]) -> Any:
    if isinstance(state_lane_id, str) and state_lane_id.startswith("replica_"):
        _late.default_role("rollout")  # the vLLM / SGLang servers' lanes
    # Inside a rollout server's hop: the link and the weight version (hops.py).
    hop = _late.hop_labels()
    state = _late.trace_state(str(state_name), state_lane_id=state_lane_id, **labels, **hop)
    state.__enter__()
    return state


class _Late:
    """What every span needs from modules this one must not import at load (``import verl`` stays
    fast), imported once on first use instead of at every call."""

    def __getattr__(self, name: str) -> Any:
        from otel_tracking.api.spans import trace_state
        from otel_tracking.distributed.worker import default_role
        from otel_tracking.verl.hops import hop_labels

        self.trace_state, self.default_role, self.hop_labels = trace_state, default_role, hop_labels
        return object.__getattribute__(self, name)


_late: Any = _Late()


def _close_span(state: Any, exc: BaseException | None) -> None:
    if state is not None:
        state.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)


def _arguments(verl_function: Any, cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by the names of verl's own signature (whatever their order, whichever
    are positional, whatever a newer verl added), keyword catch-alls merged in; ``TypeError``
    when verl itself would refuse the call (then verl is called as it is and raises its own)."""
    signature, catch_alls, plans = _signature(verl_function)
    shape = (len(args), tuple(kwargs))
    plan = plans.get(shape, _UNSEEN)
    if plan is _UNSEEN or plan is None:
        arguments = dict(signature.bind(cls, *args, **kwargs).arguments)
        for name in catch_alls:
            arguments.update(arguments.pop(name, {}))
        if plan is _UNSEEN and len(plans) < _PLANS_KEPT:  # this shape binds: how, once
            plans[shape] = _plan(signature, len(args))
        return arguments
    positional, first = plan
    arguments = {first: cls}
    arguments.update(zip(positional, args, strict=True))
    arguments.update(kwargs)
    return arguments


_UNSEEN = object()
_PLANS_KEPT = 32  # call shapes per verl function (a handful in practice)


def _plan(signature: inspect.Signature, n_args: int) -> tuple[tuple[str, ...], str] | None:
    """Where a call of this shape binds, when that depends on the shape alone: the names its
    positional arguments take (after ``cls``) and ``cls``'s own.  Keywords then keep their names,
    to a named parameter or the ``**`` catch-all (merged in anyway).  None (bind every call) when a
    ``*args`` could take positional ones."""
    parameters = list(signature.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters) or not parameters:
        return None
    by_position = [p.name for p in parameters if p.kind in _POSITIONAL]
    if len(by_position) < n_args + 1:
        return None
    return tuple(by_position[1 : n_args + 1]), by_position[0]


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@functools.lru_cache(maxsize=64)
def _signature(verl_function: Any) -> tuple[inspect.Signature, tuple[str, ...], dict[Any, Any]]:
    """verl's signature, its ``**kwargs`` names and the call shapes already bound (``_plan``), read
    once per function: ``inspect.signature`` and ``bind`` at every call were most of
    ``_arguments``' cost (bench/results/2026-12-03-verl-cpu.md)."""
    signature = inspect.signature(verl_function)
    kinds = signature.parameters.items()
    return signature, tuple(name for name, p in kinds if p.kind is inspect.Parameter.VAR_KEYWORD), {}


def _trace_state(verl_trace_state: Any) -> Any:
    verl_function = verl_trace_state.__func__  # the contextmanager function under the classmethod
    names = list(inspect.signature(verl_function).parameters)
    state_param = names[1] if len(names) > 1 else "state_name"  # after cls

    def open_span(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        arguments = _arguments(verl_function, cls, args, kwargs)
        arguments.pop(names[0], None)  # cls
        state_name = arguments.pop(state_param)
        lane = arguments.pop("state_lane_id", None)
        return _open_span(state_name, lane, arguments)  # what else it was given: labels

    class _TraceState(ContextDecorator):
        """What ``@contextmanager`` made of the function this replaces, with plain ``__enter__`` and
        ``__exit__`` (every DistProfiler call goes through it): the span around the block, verl's own
        ``trace_state`` inside it when rl_insight is enabled, an exception verl's suppresses ends
        the span as a success."""

        __slots__ = ("_call", "_state", "_verl")

        def __init__(self, cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._call = (cls, args, kwargs)
            self._verl: Any = None

        def _recreate_cm(self) -> Any:  # as a decorator: a fresh one for every call
            return _TraceState(*self._call)

        def __enter__(self) -> None:
            cls, args, kwargs = self._call
            # verl's arguments go to verl untouched; the span takes what it understands of them
            state = self._state = quietly("trace_state span", open_span, cls, args, kwargs)
            try:
                if _verl_enabled(cls):  # rl_insight gets it too
                    verl = verl_function(cls, *args, **kwargs)
                    verl.__enter__()
                    self._verl = verl
            except BaseException as exc:
                quietly("trace_state span", _close_span, state, exc)
                raise

        def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
            state, verl = self._state, self._verl
            if exc_type is not None and exc is None:
                exc = exc_type()
            if verl is not None:
                self._verl = None
                try:
                    suppressed = verl.__exit__(exc_type, exc, tb)
                except BaseException as raised:
                    quietly("trace_state span", _close_span, state, raised)
                    raise
                if suppressed:
                    exc = None
            quietly("trace_state span", _close_span, state, exc)
            return exc is None and exc_type is not None

    def trace_state(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return _TraceState(cls, args, kwargs)

    trace_state.__doc__ = verl_function.__doc__
    trace_state.__wrapped_by_otel_tracking__ = True  # type: ignore[attr-defined]
    return classmethod(trace_state)


def _gauges(data: Any, step: Any) -> None:
    from otel_tracking.distributed.worker import worker_run

    run = worker_run()
    if run is not None:
        run.observe(dict(data), step)  # OTLP gauges only, as rl_insight's; the driver's step stays log()'s


def _log(verl_log: Any) -> Any:
    verl_function = verl_log.__func__

    def gauges(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        arguments = _arguments(verl_function, cls, args, kwargs)
        _gauges(arguments["data"], arguments["step"])

    def log(cls: Any, *args: Any, **kwargs: Any) -> Any:
        quietly("RLInsightLogger.log", gauges, cls, args, kwargs)
        return verl_function(cls, *args, **kwargs)

    return classmethod(log)


def _targets(server_addresses: Any, job_name: Any, labels: Any) -> None:
    from otel_tracking.distributed.targets import register_scrape_targets

    register_scrape_targets(list(server_addresses), job_name, labels)


def _register_metrics(verl_register: Any) -> Any:
    verl_function = verl_register.__func__

    def targets(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        arguments = _arguments(verl_function, cls, args, kwargs)  # by name: reordered ones stay apart
        _targets(arguments["server_addresses"], arguments.get("job_name"), arguments.get("labels"))

    def register_metrics(cls: Any, *args: Any, **kwargs: Any) -> Any:
        quietly("RLInsightLogger.register_metrics", targets, cls, args, kwargs)
        return verl_function(cls, *args, **kwargs)

    return classmethod(register_metrics)
