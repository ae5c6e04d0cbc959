"""verl's agent loop (``agent_loop_parts.py``) driven by a verl-shaped loop as its own Ray job:
three steps, each a ``marked_timer("gen")`` around ``AgentLoopManager.generate_sequences``.

    python run_agent_loop.py --address ADDR --out result.json [--ray-first]

The weights: version 0 before step 1 (verl's first weight update, for step 1); no update after
step 1, so step 2 is served by weights one update behind, as the fully async trainer's rollouts
are; version 2 after step 2, for step 3.  It writes what the loop computed to ``--out``, then
waits for its standard input to close before it ends the job (Ray ends a job's actors at once
when its driver exits, and a server's last spans leave within its export interval).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import ray

STEPS = 3
WEIGHTS_AFTER = {2: 2}  # step -> the weight version verl's update gives the servers at its end


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ray-first", action="store_true", help="ray.init before import verl (before the switch)")
    args = parser.parse_args()
    if not args.ray_first:
        import verl  # noqa: F401  # first, as verl's entry points do: its plugins load here
    ray.init(address=args.address, runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    from agent_loop_parts import build, prompts
    from verl.utils.profiler import marked_timer
    from verl.utils.tracking import Tracking

    tracking = Tracking("verl-proj", "verl-exp", default_backend=["file"])
    manager, servers = build()
    ray.get([server.set_global_steps.remote(0) for server in servers])
    results: list[Any] = []
    for step in range(1, STEPS + 1):
        timing_raw: dict[str, float] = {}
        with marked_timer("step", timing_raw):
            with marked_timer("gen", timing_raw):
                output = manager.generate_sequences(prompts(step))
        results.append(
            {
                "responses": output.batch["responses"].tolist(),
                "weight_version": output.non_tensor_batch["weight_version"].tolist(),
            }
        )
        if step in WEIGHTS_AFTER:
            ray.get([server.set_global_steps.remote(WEIGHTS_AFTER[step]) for server in servers])
        tracking.log({f"timing_s/{name}": seconds for name, seconds in timing_raw.items()}, step)
    run_id = getattr(tracking, "run_id", None)
    tracking.finish()  # the last step's root ends with the run (or when a next step would begin)
    with open(args.out, "w") as f:
        json.dump({"results": results, "run_id": run_id}, f)
    sys.stdin.read()  # the test closes it once the spans have arrived


if __name__ == "__main__":
    main()
