"""Before Ray ends an actor, the process that ends it asks the actor to send what it holds.

Ray gives an actor no exit (see :mod:`otel_tracking.distributed.worker`): when the process that
owns or called it shuts Ray down, exits, or calls ``ray.kill``, the actor's core worker calls
``_exit`` within milliseconds.  Waiting at the end of every call until its spans have left keeps
them, but costs one OTLP request per call, a large share of a core for a worker serving many
small calls a second (``bench/bench_verl.py --parts cpu``).  So the caller's side takes that job
instead:

* a process that calls instrumented actors *remembers* each one (weakly: a handle we hold must
  not keep an actor alive) and tells it, once, that it is *covered*;
* before that process shuts Ray down, exits, or kills one of them, it asks each to deliver what it
  holds, and to ask the actors it called in turn (``__ray_call__``), all within one bounded wait;
* a covered actor's calls return at once: its spans leave at the worker run's export interval,
  a longer one than an uncovered process's (``worker.export_less_often``).

Who covers: the Ray driver (the process that ran ``ray.init``), and every actor that such a
process remembered.  A process that nobody covers (a remote function's worker, an actor called
only by processes that do not drain) waits at the end of each call, as before
(:func:`at_call_end`).  Lost still: what a covered actor holds when its coverer dies without
running Python (SIGKILL, a segfault), as the coverer's own telemetry is.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("otel_tracking")

DRAIN_TIMEOUT_S = 5.0  # one bound for the whole tree of actors; a busy or hung actor costs no more

_lock = threading.Lock()
_covered_pid: int | None = None  # this process will be asked to deliver before Ray ends it
_covering_pid: int | None = None  # this process asks the actors it calls (a driver, or covered itself)
_hooked_pid: int | None = None  # ray.shutdown / ray.kill / exit drain first, in this process
_remembered: dict[str, weakref.ref[Any]] = {}  # actor id -> its handle, for as long as it lives


def covered() -> bool:
    """Whether this process's caller will ask it to deliver before Ray ends it."""
    return _covered_pid == os.getpid()


def at_call_end() -> None:
    """The end of a traced call: a covered process returns at once, any other waits until the
    call's spans have left (:func:`~otel_tracking.distributed.worker.deliver_pending`)."""
    if covered():
        return
    from otel_tracking.distributed.worker import deliver_pending

    deliver_pending()


async def at_call_end_async() -> None:
    """:func:`at_call_end` for a coroutine (the wait runs in a thread, the event loop goes on)."""
    if covered():
        return
    from otel_tracking.distributed.worker import deliver_pending_async

    await deliver_pending_async()


def remember(handle: Any) -> None:
    """A call to an instrumented actor is being made from this process: if this process covers,
    the actor is covered too, and is asked to deliver before this process ends it."""
    if not _covering():
        return
    key = _actor_key(handle)
    if key is None:
        return
    with _lock:
        known = _remembered.get(key)
        if known is not None and known() is not None:
            return
        _remembered[key] = weakref.ref(handle)
    handle.__ray_call__.remote(_become_covered)  # queued before the call it comes with


def drain(timeout_s: float = DRAIN_TIMEOUT_S, skip: Iterable[str] = ()) -> None:
    """Ask every live actor this process remembered (but those in ``skip``, which others drain)
    to deliver what it holds and to drain the actors it remembered; wait for all of them at most
    ``timeout_s``."""
    with _lock:
        live = {key: handle for key, ref in _remembered.items() if (handle := ref()) is not None}
    skip = frozenset(skip)
    _drain({key: handle for key, handle in live.items() if key not in skip}, skip, timeout_s)


def _drain(targets: dict[str, Any], skip: frozenset[str], timeout_s: float) -> None:
    import ray

    if not targets or not ray.is_initialized():
        return
    deadline = time.monotonic() + timeout_s
    seen = skip | targets.keys()  # an actor that two processes of the tree called is drained once
    pending = []
    for handle in targets.values():
        try:  # each level gets less time than its caller waits, so the caller hears back
            pending.append(handle.__ray_call__.remote(_deliver_here, seen, timeout_s * 0.8))
        except Exception:  # an actor already gone
            logger.debug("otel-tracking: asking an actor to deliver failed", exc_info=True)
    if not pending:
        return
    done, not_done = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
    for ref in done:
        try:
            ray.get(ref)
        except Exception:  # an actor that died meanwhile has nothing left to send
            logger.debug("otel-tracking: an actor could not deliver", exc_info=True)
    if not_done:
        logger.warning(
            "otel-tracking: %d of %d actors did not say within %g s that their spans left (busy, or the endpoint "
            "hangs); what they still hold is lost when Ray ends them",
            len(not_done),
            len(pending),
            timeout_s,
        )


# --- in the actor, through __ray_call__ ---------------------------------------------------------


def _become_covered(actor: object) -> None:
    global _covered_pid, _covering_pid
    _covered_pid = _covering_pid = os.getpid()  # and it covers the actors it calls
    _hook()
    from otel_tracking.distributed.worker import export_less_often

    export_less_often()  # fewer, larger exports from now on (a run built later does it itself)


def _deliver_here(actor: object, skip: frozenset[str], timeout_s: float) -> None:
    from otel_tracking.runtime.run import current_run

    children = threading.Thread(target=drain, args=(timeout_s, skip), name="otel-tracking-drain", daemon=True)
    children.start()  # this actor's own spans and its callees' leave at the same time
    run = current_run()
    if run is not None:
        run.flush(timeout_s)
    children.join(timeout_s)


# --- this process: who covers, and the hooks that drain --------------------------------------------


def _covering() -> bool:
    """This process covers the actors it calls: it is covered itself, or it is the Ray driver.  (A
    driver covers without being covered: its own traced calls, if any, still wait.)"""
    global _covering_pid
    if _covering_pid == os.getpid():
        return True
    if not (covered() or _is_driver()):
        return False
    _covering_pid = os.getpid()
    _hook()
    return True


def _is_driver() -> bool:
    from otel_tracking.compat.ray_internals import is_driver

    return is_driver()  # without Ray's name, no process covers, and each call waits for its spans


def _actor_key(handle: Any) -> str | None:
    from otel_tracking.compat.ray_internals import actor_id

    return actor_id(handle)


def _hook() -> None:
    """``ray.shutdown()``, ``ray.kill(actor)`` and this process's exit drain first (once per
    process).  The exit hook is registered after ``import ray`` registered Ray's own, so it runs
    first (``atexit`` runs last-registered first)."""
    global _hooked_pid
    with _lock:
        if _hooked_pid == os.getpid():
            return
        _hooked_pid = os.getpid()
    import ray

    shutdown, kill = ray.shutdown, ray.kill
    if not getattr(shutdown, "_otel_tracking_drains", False):

        @functools.wraps(shutdown)
        def drained_shutdown(*args: Any, **kwargs: Any) -> Any:
            _quietly(drain)
            return shutdown(*args, **kwargs)

        drained_shutdown._otel_tracking_drains = True  # type: ignore[attr-defined]
        ray.shutdown = drained_shutdown

    if not getattr(kill, "_otel_tracking_drains", False):

        @functools.wraps(kill)
        def drained_kill(actor: Any, *args: Any, **kwargs: Any) -> Any:
            _quietly(_drain_one, actor)
            return kill(actor, *args, **kwargs)

        drained_kill._otel_tracking_drains = True  # type: ignore[attr-defined]
        ray.kill = drained_kill
    atexit.register(_quietly, drain)


def _drain_one(actor: Any) -> None:
    """Before ``ray.kill(actor)``: that actor (if remembered) delivers, and drains its own."""
    key = _actor_key(actor)
    with _lock:
        ref = _remembered.get(key) if key is not None else None
    handle = ref() if ref is not None else None
    if key is not None and handle is not None:
        _drain({key: handle}, frozenset(), DRAIN_TIMEOUT_S)


def _quietly(func: Any, *args: Any) -> None:
    try:
        func(*args)
    except Exception:  # ending Ray goes on whatever happened here
        logger.debug("otel-tracking: draining the actors failed", exc_info=True)


__all__ = ["DRAIN_TIMEOUT_S", "at_call_end", "at_call_end_async", "covered", "drain", "remember"]
