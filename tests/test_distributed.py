"""A run across processes: the driver's step as the root of one trace, workers' spans under it.

The driver is this test process (a ``Tracking`` with OTLP to a real OTLP/HTTP endpoint); the
workers are real processes (multiprocessing with spawn and fork, a plain subprocess) that never
build a ``Tracking``.  Every process seeds ``random`` alike, as training code does.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import propagate

from otel_tracking import Tracking, trace_state
from otel_tracking.distributed.propagation import attach, context_env, inject
from otel_tracking.distributed.worker import configure_worker
from tests.otlp_receiver import HttpReceiver, wait_for

REPO = Path(__file__).resolve().parents[1]


def _worker(carrier: dict[str, str], rank: int, spans: int) -> None:
    """A worker process: no Tracking, only trace_state under the context it was handed."""
    random.seed(0)
    configure_worker(role="actor", rank=rank)
    with attach(carrier):
        for _ in range(spans):
            with trace_state("update_actor", state_lane_id=f"rank_{rank}"):
                pass


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Any:
    with HttpReceiver() as r:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        yield r


def _spans_named(receiver: HttpReceiver, name: str, n: int) -> list[dict[str, Any]]:
    return wait_for(
        lambda: (found := [s for s in receiver.received.spans() if s["name"] == name]) and len(found) >= n and found,
        timeout_s=60,
        what=f"{n} {name!r} spans",
    )


def test_inject_inside_a_span_carries_traceparent_and_the_run_identity(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")
    tracking.log({"x": 1}, 4)
    with trace_state("rollout") as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the standard API, not ours
    tracking.finish()
    ids = span.get_span_context()
    version, trace_id, span_id, flags = carrier["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", f"{ids.trace_id:032x}", f"{ids.span_id:016x}")
    assert int(flags, 16) & 1, "sampled"
    baggage = dict(item.split("=", 1) for item in carrier["baggage"].split(","))
    assert baggage == {"ml.project": "proj", "ml.experiment": "exp", "ml.run.id": tracking.run_id, "ml.step": "5"}


def test_ids_come_from_the_os_not_the_seeded_random_module(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")
    seen = set()
    for _ in range(3):
        random.seed(0)
        with trace_state("phase") as span:
            context = span.get_span_context()
            seen.add((context.trace_id, context.span_id))
        tracking.log({"x": 1}, len(seen))  # a new step: a new trace
    tracking.finish()
    assert len(seen) == 3
    assert len({trace_id for trace_id, _ in seen}) == 3


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_worker_processes_continue_the_driver_step_trace(
    isolated: Path, receiver: HttpReceiver, start_method: str
) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")
    context = multiprocessing.get_context(start_method)
    pids: dict[int, int] = {}
    for step in (1, 2):
        with trace_state("update_actor_dispatch") as dispatch:
            carrier = inject()
            workers = [context.Process(target=_worker, args=(carrier, rank, 3)) for rank in (0, 1)]
            for worker in workers:
                worker.start()
            for rank, worker in enumerate(workers):
                worker.join(60)
                assert worker.exitcode == 0
                pids[step * 10 + rank] = worker.pid
        tracking.log({"loss": 1.0 / step}, step)
        assert dispatch.get_span_context().is_valid
    tracking.finish()

    worker_spans = _spans_named(receiver, "update_actor", 12)
    driver = {s["span_id"]: s for s in receiver.received.spans() if s["resource"]["process.pid"] == os.getpid()}
    roots = {s["trace_id"]: s for s in driver.values() if s["name"] == "ml.step"}
    assert sorted(root["attributes"]["ml.step"] for root in roots.values()) == [1, 2]
    assert len(worker_spans) == 12
    assert len({s["span_id"] for s in worker_spans}) == 12, "seeded alike, ids still distinct"
    for span in worker_spans:
        parent = driver[span["parent_span_id"]]  # every worker span hangs under the driver's dispatch span
        assert parent["name"] == "update_actor_dispatch"
        root = roots[span["trace_id"]]
        assert parent["parent_span_id"] == root["span_id"]
        step = root["attributes"]["ml.step"]
        rank = int(span["attributes"]["ml.lane"].removeprefix("rank_"))
        resource = span["resource"]
        assert resource["ml.run.id"] == tracking.run_id
        assert resource["ml.project"] == "proj" and resource["ml.experiment"] == "exp"
        assert resource["ml.rank"] == rank and resource["ml.role"] == "actor"
        assert resource["process.pid"] == pids[step * 10 + rank]
        assert resource["host.name"]
        # the driver's step, via baggage (none in the first step: not known before its log())
        assert span["attributes"].get("ml.step") == parent["attributes"].get("ml.step") == {1: None, 2: 2}[step]


def test_a_subprocess_continues_the_trace_from_its_environment(isolated: Path, receiver: HttpReceiver) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")
    code = textwrap.dedent(
        """
        import random
        from otel_tracking import trace_state
        random.seed(0)
        with trace_state("reward", state_lane_id="scorer"):
            with trace_state("score"):
                pass
        """
    )
    env = {**os.environ, **context_env(), "PYTHONPATH": str(REPO), "RANK": "3"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    tracking.log({"loss": 0.5}, 1)
    tracking.finish()

    score = _spans_named(receiver, "score", 1)[0]
    reward = next(s for s in receiver.received.spans() if s["name"] == "reward")
    root = wait_for(lambda: [s for s in receiver.received.spans() if s["name"] == "ml.step"], what="the step span")[0]
    assert score["parent_span_id"] == reward["span_id"]
    assert reward["parent_span_id"] == root["span_id"] and reward["trace_id"] == root["trace_id"]
    assert reward["resource"]["ml.run.id"] == tracking.run_id
    assert reward["resource"]["ml.rank"] == 3
    assert reward["resource"]["process.pid"] != os.getpid()
    # Before the first log() the step is not known yet: the root says it (1), the worker's span has none.
    assert "ml.step" not in reward["attributes"] and root["attributes"]["ml.step"] == 1


def test_a_worker_with_no_exporter_keeps_its_spans_and_says_where(isolated: Path) -> None:
    code = textwrap.dedent(
        """
        from otel_tracking import trace_state
        for i in range(5):
            with trace_state("generate", state_lane_id="replica_0"):
                pass
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OTEL_TRACKING_RUN_ID": "r-1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    spooled = list((isolated / "spool").rglob("otlp-traces.jsonl"))
    assert len(spooled) == 1
    assert "no trace exporter is configured" in done.stderr and str(spooled[0]) in done.stderr
    assert done.stderr.count("no trace exporter is configured") == 1

    with HttpReceiver() as receiver:
        replay_env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        subprocess.run(
            [sys.executable, "-m", "otel_tracking.cli.main", "replay", str(spooled[0])],
            env=replay_env,
            check=True,
            timeout=120,
            capture_output=True,
        )
        spans = _spans_named(receiver, "generate", 5)
    assert len(spans) == 5 and {s["resource"]["ml.run.id"] for s in spans} == {"r-1"}


def test_a_rollout_crossing_steps_links_to_the_step_it_serves(isolated: Path, receiver: HttpReceiver) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")
    served = inject()  # handed to a rollout for step 1, with weights of version 0
    tracking.log({"x": 1}, 1)
    with trace_state("generate", links=served, weight_version=0):
        pass
    tracking.log({"x": 2}, 2)
    tracking.finish()
    generate = _spans_named(receiver, "generate", 1)[0]
    served_trace = served["traceparent"].split("-")[1]
    assert generate["links"] == [(served_trace, served["traceparent"].split("-")[2])]
    assert generate["attributes"]["ml.weight_version"] == 0
    assert generate["trace_id"] != served_trace  # it runs in step 2's trace, linked to step 1's


COVERED_WORKER = """
import os, sys
from otel_tracking import trace_state
from otel_tracking.distributed import drain
from otel_tracking.distributed.environment import COVERED_EXPORT_INTERVAL_S
from otel_tracking.runtime.run import current_run

when = sys.argv[1]
if when == "after":
    with trace_state("uncovered_work"):  # the worker run is built before anyone covers the process
        pass
drain._become_covered(None)  # what a caller's first call sends through __ray_call__ (drain.remember)
for _ in range(50):
    with trace_state("covered_work"):
        pass
run = current_run()
intervals = {s.queue.policy.export_interval_s for s in run.all_sinks if s.queue is not None}
expected = COVERED_EXPORT_INTERVAL_S
if "OTEL_BSP_SCHEDULE_DELAY" in os.environ:
    expected = float(os.environ["OTEL_BSP_SCHEDULE_DELAY"]) / 1000
assert intervals == {expected}, intervals
assert run.flush(10.0)  # what the caller's drain does (drain._deliver_here)
os._exit(0)  # as Ray ends a worker: no exit hook; what arrives was sent by the flush
"""


@pytest.mark.parametrize("when", ["before", "after", "variable"])
def test_a_covered_worker_exports_less_often_and_its_drain_still_sends_every_span(
    isolated: Path, receiver: HttpReceiver, when: str
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if when == "variable":  # the user's own interval stays as it is
        env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    done = subprocess.run(
        [sys.executable, "-c", COVERED_WORKER, "before" if when == "variable" else when],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    spans = _spans_named(receiver, "covered_work", 50)
    assert len(spans) == 50, "each span exactly once"
    if when == "after":
        assert len(_spans_named(receiver, "uncovered_work", 1)) == 1
