"""A stand-in for the part of Ray the driver's waiting-ranks and returns logic reads, for ranks
that are threads of a few processes rather than 1,024 Ray actors (this machine cannot hold them).

``install()`` puts this module in ``sys.modules`` as ``ray`` (and the submodules
``compat/ray_internals.py`` probes), in the driver process only, before anything imports Ray.
What it keeps of Ray's interface, with Ray's meaning:

* ``ObjectRef``: a call's result, ready once the rank's host process says the call returned;
* ``wait(refs, num_returns=, timeout=, fetch_local=)``: ``(ready, not_ready)``, at most
  ``num_returns`` ready, waiting up to ``timeout`` for them (None: forever), as ``ray.wait``;
* ``get(refs)``: blocks until every ref is ready;
* ``is_initialized()``, ``get_runtime_context().runtime_env``, ``SCRIPT_MODE`` and
  ``_private.worker.global_worker.mode``: a driver whose job's workers are instrumented;
* ``actor.ActorHandle`` with ``_actor_id`` and ``_private.state.state.actor_table(hex)``: each
  simulated rank's handle and its GCS record (state, node, the pid of the process holding it).

What it does not model: Ray's transport and object store.  Per ref handed to ``wait`` its cost is
of Ray's order: on this machine Ray 2.60's ``ray.wait`` on 1,024 ready refs took 0.22 ms of CPU,
this one 0.39 ms (its ready/not-ready lists are built in Python); as in Ray, a blocked ``wait``
registers once on each ref and a ref becoming ready costs each wait blocked on it a count, not
another pass over every ref (an earlier version passed over them all at each ready ref).
"""

from __future__ import annotations

import itertools
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

SCRIPT_MODE = 0
_cond = threading.Condition()
_ids = itertools.count(1)
# How much the callers asked of ray.wait: calls, and refs handed in (Ray's own cost grows with both)
counts = {"wait_calls": 0, "wait_refs": 0}


class ObjectRef:
    __slots__ = ("__weakref__", "_done", "_waiters", "call_id")

    def __init__(self) -> None:
        self.call_id = next(_ids)
        self._done = threading.Event()
        self._waiters: list[_Waiter] = []  # the ray.wait calls blocked on it

    def hex(self) -> str:
        return f"{self.call_id:040x}"


class _Waiter:
    """One blocked ``wait``: how many more of its refs must become ready."""

    __slots__ = ("left", "woken")

    def __init__(self, left: int) -> None:
        self.left = left
        self.woken = threading.Event()


def mark_ready(refs: Sequence[ObjectRef]) -> None:
    """The host process said these calls returned: each wakes the waits it completes (Ray's
    cost per ready object, not per ref every waiter holds)."""
    with _cond:
        for ref in refs:
            ref._done.set()
            for waiter in ref._waiters:
                waiter.left -= 1
                if waiter.left <= 0:
                    waiter.woken.set()
            ref._waiters.clear()


def is_initialized() -> bool:
    return True


def wait(
    refs: Sequence[ObjectRef], *, num_returns: int = 1, timeout: float | None = None, fetch_local: bool = True
) -> tuple[list[ObjectRef], list[ObjectRef]]:
    """Per call, a pass over the refs to register and one to answer, as Ray's; a ready object
    wakes the call once it has enough."""
    if num_returns > len(refs):
        raise ValueError("num_returns cannot be greater than the number of refs")
    counts["wait_calls"] += 1
    counts["wait_refs"] += len(refs)
    with _cond:
        missing = [ref for ref in refs if not ref._done.is_set()]
        waiter = _Waiter(num_returns - (len(refs) - len(missing)))
        if waiter.left > 0 and timeout != 0:
            for ref in missing:
                ref._waiters.append(waiter)
        else:
            waiter.woken.set()
    waiter.woken.wait(timeout)
    with _cond:
        for ref in missing:
            if not ref._done.is_set() and waiter in ref._waiters:
                ref._waiters.remove(waiter)
        ready = [ref for ref in refs if ref._done.is_set()][:num_returns]
    taken = {id(ref) for ref in ready}
    return ready, [ref for ref in refs if id(ref) not in taken]


def get(refs: Any, timeout: float | None = None) -> Any:
    for ref in refs if isinstance(refs, (list, tuple)) else [refs]:
        if not ref._done.wait(timeout):
            raise TimeoutError("stand-in ray.get timed out")
    return [None] * len(refs) if isinstance(refs, (list, tuple)) else None


class _RuntimeContext:
    def __init__(self, env_vars: dict[str, str]) -> None:
        self.runtime_env = {"env_vars": env_vars}


_env_vars: dict[str, str] = {}


def get_runtime_context() -> _RuntimeContext:
    return _RuntimeContext(dict(_env_vars))


class _ActorID:
    __slots__ = ("_hex",)

    def __init__(self, hex_id: str) -> None:
        self._hex = hex_id

    def hex(self) -> str:
        return self._hex


class ActorHandle:
    """One simulated rank's handle: its id, and where its calls go (the host process)."""

    def __init__(self, rank: int, host: int) -> None:
        self.rank, self.host = rank, host
        self._id = _ActorID(f"{rank:032x}")
        self._ray_method_signatures: dict[str, Any] = {}

    @property
    def _actor_id(self) -> _ActorID:
        return self._id

    def _actor_method_call(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the scale bench's ranks are called through the worker-group stand-in")


class _State:
    def __init__(self) -> None:
        self.actors: dict[str, dict[str, Any]] = {}

    def actor_table(self, hex_id: str) -> dict[str, Any]:
        return self.actors.get(hex_id, {})


def install(env_vars: dict[str, str]) -> types.ModuleType:
    """This module as ``ray`` in this process (before anything imports the real one)."""
    if "ray" in sys.modules and sys.modules["ray"] is not sys.modules[__name__]:
        raise RuntimeError("the real ray is imported already: install the stand-in first")
    _env_vars.update(env_vars)
    ray = sys.modules[__name__]
    actor = types.ModuleType("ray.actor")
    actor.ActorHandle = ActorHandle  # type: ignore[attr-defined]
    private = types.ModuleType("ray._private")
    state = types.ModuleType("ray._private.state")
    state.state = _State()  # type: ignore[attr-defined]
    worker = types.ModuleType("ray._private.worker")
    worker.global_worker = types.SimpleNamespace(mode=SCRIPT_MODE)  # type: ignore[attr-defined]
    private.state, private.worker = state, worker  # type: ignore[attr-defined]
    ray.actor, ray._private = actor, private  # type: ignore[attr-defined]
    sys.modules.update(
        {
            "ray": ray,
            "ray.actor": actor,
            "ray._private": private,
            "ray._private.state": state,
            "ray._private.worker": worker,
        }
    )
    return ray


def register_actor(handle: ActorHandle, node: str, pid: int) -> None:
    """The GCS record ``verl/waiting.py`` reads for a waiting rank."""
    sys.modules["ray._private.state"].state.actors[handle._id.hex()] = {  # type: ignore[attr-defined]
        "State": "ALIVE",
        "Address": {"NodeID": node, "IPAddress": "127.0.0.1"},
        "Pid": pid,
    }
