"""The hops outside worker groups: the agent loop and the rollout servers continue the trace.

verl's agent loop (``verl.experimental.agent_loop``) reaches the inference engines through Ray
actors that are not worker groups::

    driver, in marked_timer("gen")            AgentLoopManager.generate_sequences
      -> AgentLoopWorker actor                   .generate_sequences.remote(chunk)
         -> LLMServerClient (in that actor)      .generate(...), one per sample, in asyncio tasks
            -> vLLM / SGLang / TRT-LLM server    server.generate.remote(...), where verl's own
               actor (one per replica)           RLInsightLogger.trace_state("vllm_generate", lane replica_<n>)

Two patches carry the caller's context across each Ray hop, as ``dispatch.py`` does for worker
groups:

* callee side, at the class, when its module loads: ``AgentLoopWorker.generate_sequences`` and
  each server's ``generate`` take one more keyword-only parameter, ``_otel_context`` (a W3C
  carrier, in ``__signature__``, which Ray reads when the actor class is made);
* caller side, ``ray.actor.ActorHandle._actor_method_call``, where every ``.remote()`` on an actor
  method ends: it adds the carrier only for a method whose signature (which travels with the
  handle) takes it, and only when the job's workers are instrumented (``dispatch``).  Every other
  actor call is left as it is, but for one thing: in an instrumented job, each actor called is
  remembered, to be asked for its spans before its caller ends it (``distributed/drain.py``).

Inside ``LLMServerClient`` nothing is needed: it runs in the agent-loop actor, and asyncio tasks
inherit the context.

**Serving another step.**  A server knows which weights it generates with: ``global_steps``, the
version verl gives it at each weight update (``set_global_steps``).  verl's trainers update the
weights at the end of step N with version N, for step N+1 (the fully async trainer logs its step
at the version itself).  When the weights are older than that (``version < step - 1``: the fully
async rollouts generated with stale weights), the server's spans do not hang under the
dispatching span: they start a trace of their own, *link* to it, and carry
``ml.weight_version``.  Otherwise they are its children (and carry ``ml.weight_version`` too).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from otel_tracking.compat.ray_internals import ACTOR_METHOD_CALL, method_parameters
from otel_tracking.verl.guard import cannot_patch, quietly

CARRIER = "_otel_context"
_PATCHED = "__otel_tracking_patched__"

# verl module -> (class, method, the attribute holding its weight version, or None)
CALLEES: dict[str, tuple[tuple[str, str, str | None], ...]] = {
    "verl.experimental.agent_loop.agent_loop": (("AgentLoopWorker", "generate_sequences", None),),
    "verl.workers.rollout.vllm_rollout.vllm_async_server": (("vLLMHttpServer", "generate", "global_steps"),),
    "verl.workers.rollout.sglang_rollout.async_sglang_server": (("SGLangHttpServer", "generate", "global_steps"),),
    "verl.workers.rollout.trtllm_rollout.trtllm_async_server": (("TRTLLMHttpServer", "generate", "global_steps"),),
}
CALLER = "ray.actor"


@dataclass(frozen=True)
class Hop:
    """What a hop's first spans get: the span they sit under (``parent``: the caller's, or none
    when they link instead), the links and the weight version."""

    parent: Any
    links: list[Any] = field(default_factory=list)
    weight_version: Any = None


_hop: contextvars.ContextVar[Hop | None] = contextvars.ContextVar("otel_tracking_verl_hop", default=None)


def hop_labels() -> dict[str, Any]:
    """``trace_state`` labels for a span opened directly inside a hop (not nested in another span
    of the hop): ``links=`` when the hop serves another step, ``weight_version=`` when known."""
    hop = _hop.get()
    if hop is None:
        return {}
    from opentelemetry import trace

    if trace.get_current_span() is not hop.parent:
        return {}  # nested: its parent carries them
    labels: dict[str, Any] = {}
    if hop.links:
        labels["links"] = hop.links
    if hop.weight_version is not None:
        labels["weight_version"] = hop.weight_version
    return labels


def patch(module: ModuleType) -> None:
    if module.__name__ == CALLER:
        _patch_caller(module)
        return
    missing = []
    for class_name, method_name, version_attribute in CALLEES.get(module.__name__, ()):
        cls = getattr(module, class_name, None)
        method = getattr(cls, method_name, None)
        if cls is None or not inspect.iscoroutinefunction(method):
            missing.append(f"{class_name}.{method_name}")
            continue
        if getattr(method, _PATCHED, False):
            continue
        setattr(cls, method_name, carrying(method, version_attribute))
    cannot_patch(module.__name__, missing)


# --- callee side -------------------------------------------------------------------------------


def carrying(method: Any, version_attribute: str | None = None) -> Any:
    """The coroutine method ``method`` taking ``_otel_context`` and continuing that trace while it
    runs (or linking to it, see the module's docstring).  ``version_attribute`` names the instance
    attribute holding the weight version."""
    from otel_tracking.verl.dispatch import _with_carrier

    signature = inspect.signature(method)
    if CARRIER in signature.parameters:
        return method

    def enter(args: tuple[Any, ...], carrier: Any) -> Any:
        version = getattr(args[0], version_attribute, None) if version_attribute and args else None
        return _enter(carrier, version)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        carrier = kwargs.pop(CARRIER, None)
        token = None if carrier is None else quietly("continuing the caller's trace", enter, args, carrier)
        try:
            return await method(*args, **kwargs)
        finally:
            quietly("continuing the caller's trace", _exit, token)
            if version_attribute is None:  # the agent loop: one call per step, its spans leave first
                await _at_call_end()  # (unless its caller will ask for them: distributed/drain.py)
            # A server's generate (one per request, many at once) does not wait for its spans: they
            # leave within the export interval, and the last interval's when its caller drains it
            # (distributed/drain.py) or, if nobody covers it, go with the server when Ray ends the job.

    functools.update_wrapper(wrapper, method)
    del wrapper.__wrapped__  # type: ignore[attr-defined]  # Ray reads the signature after inspect.unwrap
    wrapper.__signature__ = _with_carrier(signature)  # type: ignore[attr-defined]
    setattr(wrapper, _PATCHED, True)
    return wrapper


def _enter(carrier: Any, version: Any) -> tuple[Any, Any]:
    from opentelemetry import baggage, trace
    from opentelemetry import context as otel_context
    from opentelemetry.context import Context

    from otel_tracking.signals.carrier import step_from
    from otel_tracking.signals.semconv import STEP
    from otel_tracking.verl.carriers import context_of

    ctx = context_of(carrier)
    step = step_from(ctx)
    stale = isinstance(version, int) and step is not None and version < step - 1
    if stale:
        # A trace of its own, linked to the dispatching span; the run identity stays in the
        # baggage, the dispatching step does not (the spans serve another one).
        links = [trace.get_current_span(ctx).get_span_context()]
        linked = Context()
        for key, value in baggage.get_all(ctx).items():
            if key != STEP:
                linked = baggage.set_baggage(key, value, linked)
        ctx = linked
    else:
        links = []
    hop = Hop(parent=trace.get_current_span(ctx), links=links, weight_version=version)
    return otel_context.attach(ctx), _hop.set(hop)


def _exit(token: Any) -> None:
    if token is not None:
        from opentelemetry import context as otel_context

        context_token, hop_token = token
        _hop.reset(hop_token)
        otel_context.detach(context_token)


async def _at_call_end() -> None:
    from otel_tracking.verl.dispatch import _at_call_end_async

    await _at_call_end_async()


# --- caller side -------------------------------------------------------------------------------


def _patch_caller(actor: ModuleType) -> None:
    handle = getattr(actor, "ActorHandle", None)
    ray_call = getattr(handle, ACTOR_METHOD_CALL, None)
    if ray_call is None:
        cannot_patch(actor.__name__, [f"ActorHandle.{ACTOR_METHOD_CALL}"])
        return
    if getattr(ray_call, _PATCHED, False):
        return

    @functools.wraps(ray_call)
    def _actor_method_call(
        self: Any, method_name: str, args: Any = None, kwargs: Any = None, *more: Any, **options: Any
    ) -> Any:
        quietly("actor call", _remember, self)
        if (kwargs is None or CARRIER not in kwargs) and quietly("actor call", _takes_carrier, self, method_name):
            carrier = quietly("actor call", _inject)
            if carrier:
                kwargs = {**(kwargs or {}), CARRIER: carrier}
        return ray_call(self, method_name, args, kwargs, *more, **options)

    setattr(_actor_method_call, _PATCHED, True)
    setattr(handle, ACTOR_METHOD_CALL, _actor_method_call)


def _remember(handle: Any) -> None:
    """Every actor this job calls (``TaskRunner.run`` too, which takes no carrier) is asked to
    deliver before its caller ends it (``distributed/drain.py``), when the job is instrumented."""
    from otel_tracking.verl.dispatch import _workers_instrumented

    if _workers_instrumented():
        from otel_tracking.distributed.drain import remember

        remember(handle)


def _takes_carrier(handle: Any, method_name: str) -> bool:
    """The method's signature (Ray's, made where the actor class was) has our parameter, and the
    job's workers are instrumented (an uninstrumented callee would not know the keyword)."""
    if not any(getattr(p, "name", None) == CARRIER for p in method_parameters(handle, method_name)):
        return False
    from otel_tracking.verl.dispatch import _workers_instrumented

    return _workers_instrumented()


def _inject() -> dict[str, str]:
    from otel_tracking.verl.carriers import current_carrier  # not before a call: `import ray` loads no SDK

    return current_carrier()
