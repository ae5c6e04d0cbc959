"""A verl-shaped training loop from verl's own classes, run as its own Ray job (a driver process
of its own, connected to the test's cluster): the tests run it switched off, switched on each of
the three ways, and against a stand-in "future verl".

    python run_loop.py --address ADDR --out result.json [--steps 2] [--in-actor] [--setup-hook] [--ray-first]

It writes what the loop computed (to compare on and off) and the run id to ``--out``.  Like verl's
legacy trainer, it never calls ``Tracking.finish()``: the run must end at exit by itself.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import ray


def train(steps: int) -> dict[str, Any]:
    # Imported where they run, as verl's TaskRunner does: a worker class pickled from a driver
    # that was not instrumented (the setup-hook case) would carry that driver's decoration along.
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls
    from verl.utils.profiler import marked_timer, simple_timer
    from verl.utils.tracking import Tracking
    from verl_loop_workers import ActorWorker, RefWorker, batch

    tracking = Tracking("verl-proj", "verl-exp", default_backend=["file"])
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    actor = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ActorWorker), name_prefix="actor")
    colocated_pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    colocated = RayWorkerGroup(
        colocated_pool,
        create_colocated_worker_cls({"ref": RayClassWithInitArgs(cls=RefWorker)}),
        name_prefix="colocated",
    )
    ref = colocated.spawn(prefix_set={"ref"})["ref"]
    # verl calls init_model on every group before fit(): the workers' start-up is outside any phase
    # (test_stall.py starts slow actors without it: the first phase waits for them to start)
    if "LOOP_START_FLAG" not in os.environ:
        actor.flush_telemetry()
        ref.flush_telemetry()
    results: list[Any] = []
    for step in range(1, steps + 1):
        timing_raw: dict[str, float] = {}
        with marked_timer("step", timing_raw):
            with marked_timer("gen", timing_raw):
                generated = actor.generate(step)
                with simple_timer("per_sample", timing_raw):  # the agent loops' per-sample timer: no span
                    pass
            with marked_timer("old_log_prob", timing_raw):
                log_prob = actor.compute_log_prob(batch()).get()  # non-blocking: a DataProtoFuture
            with marked_timer("ref", timing_raw):
                ref_log_prob = ref.compute_ref_log_prob(batch())
            with marked_timer("update_actor", timing_raw):
                updated = actor.update_actor(batch())
                shards = actor.execute_all_sync("shard", [10 * step, 20 * step])
                plain = actor.execute_all_sync("plain", step)
        results.append(
            {
                "generate": generated,
                "log_prob": log_prob.batch["log_prob"].tolist(),
                "ref_log_prob": ref_log_prob.batch["ref_log_prob"].tolist(),
                "update": updated.batch["output"].tolist(),
                "shards": shards,
                "plain": plain,
            }
        )
        metrics = {"actor/loss": 1.0 / step, "actor/output_sum": float(sum(updated.batch["output"].tolist()))}
        metrics.update({f"timing_s/{name}": seconds for name, seconds in timing_raw.items()})
        tracking.log(metrics, step)
    actor.flush_telemetry()
    ref.flush_telemetry()
    import otel_tracking.verl

    return {
        "results": results,
        "run_id": getattr(tracking, "run_id", None),
        "tracking": type(tracking).__module__,
        "installed_by": otel_tracking.verl.installed_by(),  # in the trainer's process
    }


@ray.remote
class TaskRunner:
    """As verl's main_ppo: the trainer runs inside an actor."""

    def run(self, steps: int) -> dict[str, Any]:
        return train(steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--in-actor", action="store_true")
    parser.add_argument("--setup-hook", action="store_true")
    parser.add_argument("--ray-first", action="store_true", help="ray.init before import verl (before the switch)")
    args = parser.parse_args()
    if not args.ray_first:
        import verl  # noqa: F401  # first, as verl's entry points do: its plugins load here
    env_vars = {"PYTHONPATH": os.environ["PYTHONPATH"]}
    stuck_rank = ("LOOP_STALL_RANK", "LOOP_STALL_CALL", "LOOP_STALL_FLAG", "LOOP_STALL_BUSY", "LOOP_START_FLAG")
    for name in stuck_rank:
        if name in os.environ:
            env_vars[name] = os.environ[name]
    if args.setup_hook:  # `ray job submit --runtime-env-json ...`: the driver is left alone
        for name, value in os.environ.items():
            if name.startswith(("OTEL_", "VERL_")):
                env_vars[name] = value
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if args.setup_hook:
        runtime_env["worker_process_setup_hook"] = "otel_tracking.verl.worker_setup"
    ray.init(address=args.address, runtime_env=runtime_env, log_to_driver=True)
    outcome = ray.get(TaskRunner.remote().run.remote(args.steps)) if args.in_actor else train(args.steps)
    with open(args.out, "w") as f:
        json.dump(outcome, f)


if __name__ == "__main__":
    main()
