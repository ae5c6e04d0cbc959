"""A training script with credentials planted everywhere they can hide, for ``test_secrets``.

Run as ``python -m tests.secrets_training PLAN.json [hydra-style overrides...]`` in a process of
its own, so that the test sees everything it and its bridge process (which inherits its stdout and
stderr) print.  PLAN.json holds ``backends``, ``config``, ``logged`` (one non-number value logged
with every step), ``label`` (a ``trace_state`` label value), ``error`` (a message a phase raises)
and ``generation`` (a validation sample's input).  The last line on stdout is the JSON of
``finish()``'s stats."""

from __future__ import annotations

import json
import logging
import sys


def main(argv: list[str]) -> int:
    # Every logger at DEBUG, here and (through the sitecustomize the test puts on PYTHONPATH) in the
    # bridge process: the test greps every log record either process emits.
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    from otel_tracking import Tracking, ValidationGenerationsLogger, trace_state

    with open(argv[0]) as file:
        plan = json.load(file)
    backends = plan["backends"]
    tracking = Tracking("secrets", "run", default_backend=backends, config=plan["config"])
    for step in range(1, 4):
        with trace_state("rollout", state_lane_id=0, endpoint=plan["label"], model="actor", step=step):
            tracking.log({"train/loss": 1.0 / step, "notes/text": plan["logged"]}, step)
    try:
        with trace_state("upload", step=3):
            raise ConnectionError(plan["error"])
    except ConnectionError:
        pass
    ValidationGenerationsLogger().log(backends, [(plan["generation"], "an answer", 1.0)], 3)
    stats = tracking.finish()
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
