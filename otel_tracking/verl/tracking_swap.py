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
from collections.abc import Iterator
from contextlib import contextmanager
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
    from otel_tracking.api.spans import trace_state
    from otel_tracking.distributed.worker import default_role
    from otel_tracking.verl.hops import hop_labels

    if isinstance(state_lane_id, str) and state_lane_id.startswith("replica_"):
        default_role("rollout")  # the vLLM / SGLang servers' lanes
    # Inside a rollout server's hop: the link and the weight version (hops.py).
    state = trace_state(str(state_name), state_lane_id=state_lane_id, **labels, **hop_labels())
    state.__enter__()
    return state


def _close_span(state: Any, exc: BaseException | None) -> None:
    if state is not None:
        state.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)


def _arguments(verl_function: Any, cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by the names of verl's own signature (whatever their order, whichever
    are positional, whatever a newer verl added), keyword catch-alls merged in; ``TypeError``
    when verl itself would refuse the call (then verl is called as it is and raises its own)."""
    signature, catch_alls = _signature(verl_function)
    arguments = dict(signature.bind(cls, *args, **kwargs).arguments)
    for name in catch_alls:
        arguments.update(arguments.pop(name, {}))
    return arguments


@functools.lru_cache(maxsize=64)
def _signature(verl_function: Any) -> tuple[inspect.Signature, tuple[str, ...]]:
    """verl's signature and its ``**kwargs`` names, read once per function: ``inspect.signature``
    at every call was most of ``_arguments``' cost (bench/results/2026-12-03-verl-cpu.md)."""
    signature = inspect.signature(verl_function)
    kinds = signature.parameters.items()
    return signature, tuple(name for name, p in kinds if p.kind is inspect.Parameter.VAR_KEYWORD)


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

    @contextmanager
    def trace_state(cls: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        # verl's arguments go to verl untouched; the span takes what it understands of them
        state = quietly("trace_state span", open_span, cls, args, kwargs)
        try:
            if _verl_enabled(cls):  # rl_insight gets it too
                with verl_function(cls, *args, **kwargs):
                    yield
            else:
                yield
        except BaseException as exc:
            quietly("trace_state span", _close_span, state, exc)
            raise
        quietly("trace_state span", _close_span, state, None)

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
