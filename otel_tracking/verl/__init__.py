"""verl, unchanged: one switch turns a verl run into OpenTelemetry signals, one trace per step.

Three ways to switch it on, all calling :func:`install`:

* ``OTEL_TRACKING_VERL=1`` with verl >= 0.9: verl imports every ``verl.plugins`` entry point on
  ``import verl``, in every process (``plugin.py``);
* ``opentelemetry-instrument python -m verl.trainer.main_ppo ...``: the ``opentelemetry_instrumentor``
  entry point named ``verl`` (``instrumentor.py``; verl 0.7 and 0.8 too);
* ``worker_process_setup_hook="otel_tracking.verl.worker_setup"`` in Ray's ``runtime_env``
  (``ray job submit``): :func:`worker_setup` in every Ray worker.

``install`` only registers post-import hooks (``hooks.py``); each patch is applied when the verl
module it concerns has loaded:

=====================================  ========================================================
``verl.utils.tracking``                ``Tracking``, ``ValidationGenerationsLogger`` and
                                       ``DapoFilteredRewardTableLogger`` become ours;
                                       ``RLInsightLogger.trace_state`` / ``.log`` /
                                       ``.register_metrics`` record (``tracking_swap.py``)
``verl.utils.profiler.performance``    every ``marked_timer`` opens a span named after its key
                                       (``timers.py``)
``verl.single_controller.*``           the caller's context travels with every worker-group
                                       call; each worker says its role (``dispatch.py``)
``verl.experimental.agent_loop.*``,    the caller's context travels into the agent-loop workers
the rollout servers, ``ray.actor``     and the rollout servers (``hops.py``)
``ray``                                ``ray.init`` gets the run's ``runtime_env`` (``ray_env.py``)
=====================================  ========================================================

This package imports only the standard library until those modules load, applies each patch once
per process, and never lets an error of ours reach verl (``guard.py``).
"""

from __future__ import annotations

import sys
import threading

from otel_tracking.verl import hooks, switch

_lock = threading.Lock()
# The agent loop's and the rollout servers' modules (hops.CALLEES; hops.py imports only the
# standard library too, but is loaded only when one of them is).
_HOPS = (
    "verl.experimental.agent_loop.agent_loop",
    "verl.workers.rollout.vllm_rollout.vllm_async_server",
    "verl.workers.rollout.sglang_rollout.async_sglang_server",
    "verl.workers.rollout.trtllm_rollout.trtllm_async_server",
)
_installed_by: str | None = None

# What each verl module gets, in the order verl imports them.
_TARGETS = (
    ("ray", "otel_tracking.verl.ray_env"),
    ("verl.utils.tracking", "otel_tracking.verl.tracking_swap"),
    ("verl.utils.profiler.performance", "otel_tracking.verl.timers"),
    ("verl.single_controller.base.decorator", "otel_tracking.verl.dispatch"),
    ("verl.single_controller.ray.base", "otel_tracking.verl.dispatch"),
    ("ray.actor", "otel_tracking.verl.hops"),
    *((name, "otel_tracking.verl.hops") for name in _HOPS),
)
_WHAT = (
    "Tracking and its loggers, RLInsightLogger, marked_timer spans, worker-group calls, "
    "agent-loop and rollout-server calls, ray.init runtime_env"
)


def install(source: str = "install()") -> bool:
    """Instrument verl in this process (idempotent); ``source`` says which switch asked.  Returns
    False when it was already installed."""
    global _installed_by
    with _lock:
        if _installed_by is not None:
            return False
        _installed_by = source
    for module_name, patcher in _TARGETS:
        hooks.when_imported(module_name, _patch_with(patcher))
    if not switch.in_ray_worker(sys.argv[0] if sys.argv else ""):
        print(f"otel-tracking: verl instrumented ({source}): {_WHAT}", file=sys.stderr, flush=True)
    return True


def installed_by() -> str | None:
    """Which switch instrumented this process, if any."""
    return _installed_by


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: instrument this worker process."""
    install("worker_process_setup_hook")


def _patch_with(patcher: str) -> hooks.Hook:
    def patch(module: object) -> None:
        from otel_tracking.verl.guard import quietly

        def apply() -> None:
            import importlib

            importlib.import_module(patcher).patch(module)

        quietly(f"instrumenting {getattr(module, '__name__', module)}", apply)

    return patch


__all__ = ["install", "installed_by", "worker_setup"]
