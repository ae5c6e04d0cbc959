"""A verl-shaped loop for the step's anatomy (test_anatomy.py), on verl's own classes, switched on
from outside: 4 actor ranks whose ``update_actor`` take ``LOOP_UPDATE_S`` seconds each, a ``gen``
phase of 0.3 s on the driver and 0.3 s of every step in no phase.

    python run_anatomy.py --address ADDR --out result.json [--steps 3]

It writes its own timings per step to ``--out``: the test holds the anatomy the file sink got to them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import ray

GEN_S = 0.3
OUTSIDE_S = 0.3


def train(steps: int) -> dict[str, Any]:
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.profiler import marked_timer
    from verl.utils.tracking import Tracking
    from verl_loop_workers import ActorWorker, batch

    tracking = Tracking("verl-proj", "verl-exp", default_backend=["file"])
    pool = RayResourcePool([4], use_gpu=False, max_colocate_count=1)
    actor = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ActorWorker), name_prefix="actor")
    actor.update_actor(batch(8))  # warmed up before the first step, as verl's init_model does
    own: list[dict[str, Any]] = []
    for step in range(1, steps + 1):
        started = time.time()
        timing_raw: dict[str, float] = {}
        with marked_timer("step", timing_raw):
            with marked_timer("gen", timing_raw):
                time.sleep(GEN_S)
            with marked_timer("update_actor", timing_raw):
                took = actor.update_actor(batch(8)).batch["took"].tolist()  # two rows per rank
            time.sleep(OUTSIDE_S)  # the driver's own bookkeeping, in no phase
        tracking.log({f"timing_s/{name}": seconds for name, seconds in timing_raw.items()}, step)
        own.append({"wall_s": time.time() - started, "ranks_s": took[::2], **timing_raw})
    actor.flush_telemetry()
    return {"own": own, "run_id": getattr(tracking, "run_id", None)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import verl  # noqa: F401  # first, as verl's entry points do: its plugins load here

    env_vars = {"PYTHONPATH": os.environ["PYTHONPATH"], "LOOP_UPDATE_S": os.environ["LOOP_UPDATE_S"]}
    ray.init(address=args.address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
    with open(args.out, "w") as f:
        json.dump(train(args.steps), f)


if __name__ == "__main__":
    main()
