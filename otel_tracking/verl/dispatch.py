"""The caller's trace context through every worker-group call, into the worker.

Two patches, one on each side of the single controller:

* ``verl.single_controller.base.decorator.register`` (worker side, at class definition): every
  registered method takes one more keyword-only parameter, ``_otel_context`` (a W3C carrier), and
  continues the caller's trace while it runs; its ``MAGIC_ATTR`` says so.  Colocated workers'
  forwarders copy that attribute and forward ``**kwargs``, so they take it too.  The first call also
  tells the process its role (actor, rollout, ref, critic, reward).
* ``RayWorkerGroup._execute_remote_single_worker`` (driver side), where every worker-group call
  ends (sync, non-blocking, list-split, fused): it adds the carrier, only for methods that take it.
  A method without ``@register`` (``execute_all_sync("name")``) gets no keyword it does not know.
  It also tells ``waiting.py`` (whom a stuck phase waits for) and ``returns.py`` (when each rank's
  result was ready, for the step's anatomy) of the call.

Inside the worker, DistProfiler's ``trace_state`` spans then hang under the driver's phase that
dispatched the call, and the worker's run takes the run identity from the carrier's baggage.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any

from otel_tracking.compat import verl_internals
from otel_tracking.verl.guard import cannot_patch, failed, logger, quietly
from otel_tracking.verl.roles import role_of

CARRIER = "_otel_context"  # the same keyword as otel_tracking.distributed.ray_tracing's
TAKES_CARRIER = "otel_tracking.signals.carrier"  # a key in verl's MAGIC_ATTR dict of a method we wrapped
_PATCHED = "__otel_tracking_patched__"


def patch(module: ModuleType) -> None:
    if module.__name__.endswith(".decorator"):
        _patch_register(module)
    else:
        _patch_worker_group(module)


# --- worker side -------------------------------------------------------------------------------


def _patch_register(decorator: ModuleType) -> None:
    verl_register = getattr(decorator, "register", None)
    magic = getattr(decorator, "MAGIC_ATTR", None)
    if not callable(verl_register) or not isinstance(magic, str):
        cannot_patch(decorator.__name__, [n for n in ("register", "MAGIC_ATTR") if not hasattr(decorator, n)])
        return
    if getattr(verl_register, _PATCHED, False):
        return

    @functools.wraps(verl_register)
    def register(*args: Any, **kwargs: Any) -> Any:
        verl_decorator = verl_register(*args, **kwargs)

        def decorator(func: Any) -> Any:
            method = verl_decorator(func)
            return quietly("register", _taking_carrier, method, magic, default=method)

        return decorator

    setattr(register, _PATCHED, True)
    decorator.verl_register = verl_register  # type: ignore[attr-defined]
    decorator.register = register  # type: ignore[attr-defined]


def _taking_carrier(method: Any, magic: str) -> Any:
    signature = inspect.signature(method)
    if CARRIER in signature.parameters:
        return method

    wrapper: Any
    if inspect.iscoroutinefunction(method):

        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            carrier = kwargs.pop(CARRIER, None)
            token = None if carrier is None else quietly("continuing the caller's trace", _attach, carrier, args)
            try:
                return await method(*args, **kwargs)
            finally:
                quietly("continuing the caller's trace", _detach, token)
                await _at_call_end_async()

        wrapper = async_wrapper
    else:

        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            # Every worker-group call: quietly()'s guard written out, no call to it.
            carrier = kwargs.pop(CARRIER, None)
            token = None
            if carrier is not None:
                try:
                    token = _attach(carrier, args)
                except Exception as exc:
                    failed("continuing the caller's trace", exc)
            try:
                return method(*args, **kwargs)
            finally:
                if token is not None:
                    try:
                        _late.detach(token)
                    except Exception as exc:
                        failed("continuing the caller's trace", exc)
                try:  # Ray ends a worker with _exit a few ms after its driver lets go (distributed/worker.py
                    # says why): what a call recorded leaves before the call returns, unless its caller
                    # will ask for it (drain.py).
                    _late.at_call_end()
                except Exception as exc:
                    failed("sending the call's spans", exc)

        wrapper = sync_wrapper
    functools.update_wrapper(wrapper, method)
    del wrapper.__wrapped__  # Ray checks calls against __signature__, after inspect.unwrap
    wrapper.__signature__ = _with_carrier(signature)
    setattr(wrapper, magic, {**getattr(method, magic), TAKES_CARRIER: True})
    return wrapper


def _with_carrier(signature: inspect.Signature) -> inspect.Signature:
    from otel_tracking.distributed.ray_tracing import _with_carrier as with_carrier

    return with_carrier(signature)


def _attach(carrier: Any, args: tuple[Any, ...]) -> Any:
    if args:
        _late.default_role_of(args[0], role_of)
    return _late.attach(_late.context_of(carrier))


class _Late:
    """What every call needs from modules this one does not import at load (``import verl`` stays
    fast), imported once on first use instead of at every call."""

    def __getattr__(self, name: str) -> Any:
        from opentelemetry import context

        from otel_tracking.distributed.drain import at_call_end
        from otel_tracking.distributed.worker import default_role_of
        from otel_tracking.verl.carriers import context_of

        self.attach, self.detach, self.context_of = context.attach, context.detach, context_of
        self.default_role_of, self.at_call_end = default_role_of, at_call_end
        return object.__getattribute__(self, name)


_late: Any = _Late()


async def _at_call_end_async() -> None:
    from otel_tracking.distributed.drain import at_call_end_async

    try:
        await at_call_end_async()
    except Exception as exc:  # never reaches verl's code
        quietly("sending the call's spans", _raise, exc)


def _raise(exc: Exception) -> None:
    raise exc


def _detach(token: Any) -> None:
    if token is not None:
        from opentelemetry import context

        context.detach(token)


# --- driver side -------------------------------------------------------------------------------


def _patch_worker_group(base: ModuleType) -> None:
    found = verl_internals.worker_group_execute(base)
    if found is None:
        cannot_patch(base.__name__, ["RayWorkerGroup._execute_remote_single_worker"])
        return
    group, verl_execute = found
    if getattr(verl_execute, _PATCHED, False):
        return
    from otel_tracking.verl.carriers import current_carrier

    @functools.wraps(verl_execute)
    def _execute_remote_single_worker(self: Any, worker: Any, method_name: str, *args: Any, **kwargs: Any) -> Any:
        if (
            CARRIER not in kwargs
            and quietly("worker-group call", _workers_instrumented, default=False)
            and quietly("worker-group call", _takes_carrier, self, method_name, default=False)
        ):
            carrier = quietly("worker-group call", current_carrier)
            if carrier:
                kwargs[CARRIER] = carrier
        ref = verl_execute(self, worker, method_name, *args, **kwargs)
        quietly("worker-group call", waiting.remember, self, worker, ref)  # whom a stall waits for
        quietly("worker-group call", returns.sent, self, worker, method_name, ref)  # the step's anatomy
        return ref

    from otel_tracking.runtime import stalls
    from otel_tracking.verl import returns, waiting

    stalls.add_waiting_source(waiting.waiting_for)
    setattr(_execute_remote_single_worker, _PATCHED, True)
    verl_internals.replace_worker_group_execute(group, _execute_remote_single_worker)


_instrumented: list[bool] = []  # this job's workers: instrumented or not (decided once per process)


def _workers_instrumented() -> bool:
    """Whether this Ray job's workers are instrumented too (the switch or our setup hook in its
    ``runtime_env``, as our ``ray.init`` puts them): a carrier sent to a worker whose methods are
    verl's own would be a keyword they do not know.  When not (``ray.init`` ran before the switch),
    calls carry no context, and one warning says why."""
    if not _instrumented:
        import ray

        if not ray.is_initialized():
            return False  # no job yet (get_runtime_context would start one); asked again next call
        from otel_tracking.verl import switch
        from otel_tracking.verl.ray_env import SETUP_HOOK

        runtime_env = ray.get_runtime_context().runtime_env or {}
        env_vars = runtime_env.get("env_vars") or {}
        hook = str(runtime_env.get("worker_process_setup_hook") or "") + str(env_vars.get(_RAY_HOOK_VAR) or "")
        on = str(env_vars.get(switch.SWITCH, "")).strip().lower() in switch.TRUE or SETUP_HOOK in hook
        if not on:
            logger.warning(
                "otel-tracking: this Ray job's workers are not instrumented (ray.init ran before otel_tracking.verl "
                "was switched on, and its runtime_env has neither %s=1 nor worker_process_setup_hook=%s): "
                "worker-group calls carry no trace context",
                switch.SWITCH,
                SETUP_HOOK,
            )
        _instrumented.append(on)
    return _instrumented[0]


_RAY_HOOK_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # where Ray keeps a job's setup hook


def _takes_carrier(group: Any, method_name: str) -> bool:
    cache = group.__dict__.setdefault("_otel_tracking_takes_carrier", {})
    takes = cache.get(method_name)
    if takes is None:
        takes = cache[method_name] = _resolve(group, method_name)
    return bool(takes)


def _resolve(group: Any, method_name: str) -> bool:
    """Whether the method the call lands on is one of ours (the class the group was built from; for
    a fused worker, the sub-worker's class behind ``_fuw_execute``)."""
    cls_with_init = getattr(group, "ray_cls_with_init", None)
    cls = getattr(cls_with_init, "cls", None)
    if cls is None:
        return False
    if getattr(group, "fused_worker_used", False) and method_name not in (group.method_names or ()):
        cls = cls.raw_cls_dict[group.sub_cls_name]
    cls = getattr(cls, "__ray_actor_class__", cls)
    from verl.single_controller.base.decorator import MAGIC_ATTR

    attrs = getattr(getattr(cls, method_name, None), MAGIC_ATTR, None)
    return isinstance(attrs, dict) and bool(attrs.get(TAKES_CARRIER))
