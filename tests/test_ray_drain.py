"""The caller drains its actors before Ray ends them (``otel_tracking/distributed/drain.py``).

Each case is a driver script of its own, on a fresh local Ray cluster, against a real OTLP/HTTP
endpoint (``tests/otlp_receiver.py``), ending the way users end Ray: ``ray.shutdown()`` right
after the last call, returning from the script (Ray's own exit hook shuts down), or
``ray.kill(actor)``.  The workers hold their spans for 10 s (``OTEL_BSP_SCHEDULE_DELAY``, a
worker run's export interval), longer than any of these endings takes, so that nothing leaves
by luck.  Ray then force-kills the actors within milliseconds and runs no Python code
in them (docs/guides/distributed.md, *What Ray does to its workers at the end*), so every span that arrives was sent
before the driver let go:

* flat: the driver calls a ``@traced`` actor through ``with_context``: the actor is covered, its
  calls return at once (their spans share a few requests), and the driver's ending asks it for
  them;
* nested: the driver calls an actor that calls another actor: the middle one covers the leaf, and
  the driver's drain reaches the leaf through it;
* uncovered: the driver calls the traced actor without ``with_context``: nobody promised to
  drain it, so each call waits for its own spans (one request per call) and none is lost either;
* busy: an actor still inside a long call when the driver shuts down cannot answer: the driver
  waits one bounded time, says so once, and exits;
* driver-traced: the driver covers its actors, but nobody covers the driver: a traced call it
  makes in its own process still waits for its spans (it then ends with ``os._exit``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.otlp_receiver import HttpReceiver, wait_for

REPO = Path(__file__).resolve().parents[1]
CALLS = 20

DRIVER = """
import os, sys, time
import ray
from otel_tracking import trace_state
from otel_tracking.ray_tracing import runtime_env, traced, with_context

@ray.remote
@traced
class Leaf:
    def __init__(self, rank):
        self.rank = rank
    def work(self, i):
        with trace_state("leaf_work", state_lane_id=f"rank_{self.rank}"):
            return i
    def stall(self, seconds):
        time.sleep(seconds)

@ray.remote
@traced
class Middle:
    def __init__(self):
        self.leaf = Leaf.options(runtime_env=runtime_env()).remote(1)
    def run(self, n):
        with trace_state("middle_run"):
            return ray.get([with_context(self.leaf).work.remote(i) for i in range(n)])

@traced
def driver_work():
    with trace_state("driver_work"):
        return 1

shape, ending, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ray.init(num_cpus=4, include_dashboard=False)
env = runtime_env()
with trace_state("dispatch"):
    if shape == "nested":
        top = Middle.options(runtime_env=env).remote()
        assert ray.get(with_context(top).run.remote(n)) == list(range(n))
    else:
        top = Leaf.options(runtime_env=env).remote(0)
        caller = top if shape == "uncovered" else with_context(top)
        assert ray.get([caller.work.remote(i) for i in range(n)]) == list(range(n))
        if shape == "busy":
            # still running when the driver shuts down: the drain's request queues behind it
            with_context(top).stall.remote(60)
if ending == "shutdown":
    ray.shutdown()
elif ending == "kill":
    ray.kill(top)
# "exit": the script returns, Ray's exit hook shuts down
if shape == "driver-traced":
    driver_work()  # the driver covered its actors, but nobody covers the driver: this call waits
    os._exit(0)  # no exit hook of the driver's own: what its call made must have left already
"""


def run_driver(tmp: Path, shape: str, ending: str) -> tuple[list[dict[str, Any]], list[Any], str]:
    script = tmp / "driver.py"
    script.write_text(DRIVER)
    with HttpReceiver() as receiver:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "PYTHONPATH": str(REPO)}
        if shape != "busy":  # the workers hold their spans for 10 s: only a drain (or a call's wait) sends them
            env["OTEL_BSP_SCHEDULE_DELAY"] = "10000"
        done = subprocess.run(
            [sys.executable, str(script), shape, ending, str(CALLS)],
            env=env,
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        # The driver has exited and its actors are dead: what arrives now was sent before. The
        # wait is for the receiver's threads only.
        expected = CALLS + (shape in ("nested", "driver-traced"))
        wait_for(
            lambda: (
                sum(s["name"] in ("leaf_work", "middle_run", "driver_work") for s in receiver.received.spans())
                >= expected
            ),
            timeout_s=30,
            what=f"the actors' {expected} spans",
        )
        return receiver.received.spans(), list(receiver.received.traces), done.stderr


def leaf_requests(requests: list[Any]) -> int:
    """Trace export requests that carried a leaf_work span."""
    return sum(
        any(span.name == "leaf_work" for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans)
        for request in requests
    )


COVERED = [(shape, ending) for shape in ("flat", "nested") for ending in ("shutdown", "exit", "kill")]


@pytest.mark.parametrize(("shape", "ending"), COVERED)
def test_every_span_of_a_covered_actor_arrives_and_its_calls_did_not_wait(
    isolated: Path, shape: str, ending: str
) -> None:
    spans, requests, _ = run_driver(isolated, shape, ending)
    work = [s for s in spans if s["name"] == "leaf_work"]
    assert sorted(s["attributes"].get("ml.lane") for s in work) == [f"rank_{int(shape == 'nested')}"] * CALLS
    assert len(work) == CALLS, "each call's span exactly once"
    if shape == "nested":
        (middle,) = [s for s in spans if s["name"] == "middle_run"]
        assert {s["parent_span_id"] for s in work} == {middle["span_id"]}
    # covered: the calls returned at once and their spans left together, not one request each
    assert leaf_requests(requests) <= CALLS // 4, leaf_requests(requests)


def test_an_actor_nobody_covers_waits_at_each_call_and_loses_nothing(isolated: Path) -> None:
    spans, requests, _ = run_driver(isolated, "uncovered", "shutdown")
    assert sum(s["name"] == "leaf_work" for s in spans) == CALLS
    assert leaf_requests(requests) >= CALLS // 2, "each call waited until its span had left"


def test_a_driver_that_covers_its_actors_still_waits_at_the_end_of_its_own_traced_calls(isolated: Path) -> None:
    spans, _, _ = run_driver(isolated, "driver-traced", "shutdown")
    assert sum(s["name"] == "leaf_work" for s in spans) == CALLS
    assert [s["name"] for s in spans if s["name"] == "driver_work"] == ["driver_work"]


def test_a_busy_actor_costs_the_driver_one_bounded_wait_and_one_warning(isolated: Path) -> None:
    spans, _, stderr = run_driver(isolated, "busy", "shutdown")
    assert sum(s["name"] == "leaf_work" for s in spans) == CALLS, "what the actor held before its long call"
    assert stderr.count("actors did not say within") == 1, stderr[-4000:]
