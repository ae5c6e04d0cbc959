"""Batching across steps for MLflow (issue 22), as a model-based test.

Hypothesis drives the real delivery path of one tracker sink: its log (``LogWriter``), its
``LogReader`` and ``Sink``, and the real ``MlflowSession`` packing the steps waiting in the log into
``log_batch`` requests in lanes; then replay's reader on what is left.
The MLflow client is the only stand-in, because it is where faults are injected: it checks every
request with MLflow's own validators (``_validate_batch_log_limits``, the request's JSON as
MLflow's REST store writes it, within ``MAX_BATCH_LOG_REQUEST_SIZE``), and fails requests on a
drawn schedule (nothing of a failed request lands, as in MLflow's one transaction per request).

Whatever the steps, keys and faults: every request is within the limits, every (key, step,
value) arrives exactly once once the log is replayed (never twice: no point that landed is
sent again, across retries and replay), and each key's live points arrive in the order they
were logged.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.resources import Resource

from otel_tracking.config.policy import Policy
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.reader import LogReader
from otel_tracking.delivery.spool import LogWriter, Spool
from otel_tracking.delivery.tracker_logs import count_from_log
from otel_tracking.exporters import mlflow as mlflow_bridge
from otel_tracking.exporters._base import SinkParts
from otel_tracking.exporters._batching import Limits, lanes
from otel_tracking.signals.steps import StepBatch

pytestmark = pytest.mark.backend  # needs the mlflow package (its entities and validators)

RESOURCE = Resource({})


class FaultyMlflowClient:
    """``log_batch`` as MLflow's server takes it: checked by MLflow's validators, all or nothing,
    failing on the drawn schedule (True: this call fails)."""

    def __init__(self, schedule: list[bool], limits: Limits) -> None:
        self.schedule = schedule
        self.calls = itertools.count()
        self.limits = limits
        self.lock = threading.Lock()
        self.arrived: list[tuple[str, int, float]] = []
        self.requests: list[int] = []

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = ()) -> None:
        from mlflow.protos.service_pb2 import LogBatch
        from mlflow.utils.proto_json_utils import message_to_json
        from mlflow.utils.validation import (
            MAX_BATCH_LOG_REQUEST_SIZE,
            _validate_batch_log_api_req,
            _validate_batch_log_limits,
        )

        metrics = list(metrics)
        _validate_batch_log_limits(metrics, [], [])
        body = message_to_json(LogBatch(run_id=run_id, metrics=[m.to_proto() for m in metrics]))
        _validate_batch_log_api_req(body)
        # Within the limits the code packs to (small ones here, so that hypothesis reaches the edges):
        assert len(metrics) <= self.limits.points, len(metrics)
        assert len(metrics) == 1 or len(body) <= min(self.limits.bytes + 100, MAX_BATCH_LOG_REQUEST_SIZE), len(body)
        with self.lock:
            fails = self.schedule[next(self.calls) % len(self.schedule)]
            if fails:
                raise ConnectionError("injected: the server did not take this request")
            self.requests.append(len(metrics))
            self.arrived.extend((m.key, m.step, m.value) for m in metrics)


keys = st.lists(
    st.lists(st.text("abcdefgh_", min_size=1, max_size=12), min_size=1, max_size=4).map(lambda p: "k" + "/".join(p)),
    min_size=1,
    max_size=12,
    unique=True,
)


@st.composite
def runs(draw: Any) -> list[tuple[int, list[str]]]:
    """log() calls: a step (any order, repeats allowed) and the keys it logs."""
    pool = draw(keys)
    return draw(
        st.lists(
            st.tuples(st.integers(0, 30), st.lists(st.sampled_from(pool), unique=True, max_size=len(pool))),
            min_size=1,
            max_size=25,
        )
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    calls=runs(),
    schedule=st.lists(st.booleans(), min_size=1, max_size=8),
    points=st.integers(1, 9),
    byte_limit=st.integers(150, 800),
    attempts=st.integers(1, 3),
    held=st.booleans(),
)
# A request failing between two that land: a lane that went on past it would land the key's
# later step first.
@example(
    calls=[(0, ["ka"]), (1, ["ka"])], schedule=[True, False, False], points=1, byte_limit=800, attempts=2, held=True
)
def test_any_steps_any_faults_every_point_once_within_the_limits_in_order(
    monkeypatch: pytest.MonkeyPatch,
    calls: list[tuple[int, list[str]]],
    schedule: list[bool],
    points: int,
    byte_limit: int,
    attempts: int,
    held: bool,
) -> None:
    limits = Limits(points=points, bytes=byte_limit)
    monkeypatch.setattr(mlflow_bridge, "BATCH_LIMITS", limits)
    client = FaultyMlflowClient(schedule, limits)
    session = mlflow_bridge.MlflowSession(client, "run", "0", "http://127.0.0.1:9", "proj")
    root = Path(tempfile.mkdtemp(prefix="land-"))
    try:
        sink = Sink("mlflow", SinkParts(metrics=mlflow_bridge.EXPORTERS.metrics(session)))
        policy = Policy(max_attempts=attempts, backoff_s=0.001, backoff_max_s=0.002, probe_interval_s=0.005)
        log = Spool(root / "mlflow.jsonl", {"sink": "mlflow"})
        writer = LogWriter({"mlflow": log})
        reader = LogReader(log.path, sink, policy, RESOURCE, follow=True)
        if not held:  # held: the tracker opens after every step was logged (they wait in its log)
            reader.start()
        logged: list[tuple[str, int, float]] = []
        for index, (step, names) in enumerate(calls):
            scalars = {key: float(index * 1000 + position) for position, key in enumerate(names)}
            logged += [(key, step, value) for key, value in scalars.items()]
            writer.append(["mlflow"], "step", StepBatch(RESOURCE, step, scalars, {}, 1_700_000_000_000_000_000 + index))
        writer.close()
        if held:
            reader.start()
        reader.drain(0.5, since=time.monotonic())  # a tracker that takes nothing for 0.5 s: the rest stays
        reader.stop()
        deadline = time.monotonic() + 30  # (its export on the way ends: replay must not overlap it)
        while not reader.done and time.monotonic() < deadline:
            time.sleep(0.01)
        count_from_log(sink, writer)
        assert sink.stats.dropped == 0
        assert sink.stats.delivered + sink.stats.spooled == len(calls), sink.stats

        live = list(client.arrived)
        # Live, each key's points arrive in the order they were logged (a value says its log() call).
        for key in {k for k, _, _ in logged}:
            values = [value for k, _, value in live if k == key]
            assert values == sorted(values), (key, values)

        # Replay what is left (only what had not landed) into a healthy MLflow.
        client.schedule = [False]
        if log.path.exists():
            replay = LogReader(log.path, sink, policy, RESOURCE, follow=False, at_most_once=True)
            assert replay.run() == "delivered" and replay.damaged == 0
        assert sorted(client.arrived) == sorted(logged)  # every point, exactly once
    finally:
        shutil.rmtree(root, ignore_errors=True)


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10), max_size=40),
    count=st.integers(1, 6),
)
def test_lanes_hold_whole_keys_in_order_grouped_and_balanced(calls: list[list[str]], count: int) -> None:
    """Every point in one lane, each key's points in one lane in the order given and side by side
    there, and the lanes within one key's points of each other (a request then holds few keys, and
    no lane sends a request more than the others because the hash of its keys fell unevenly)."""
    points = [(index, key, (index, key)) for index, keys in enumerate(calls) for key in keys]
    split = lanes(points, count)
    assert len(split) == count
    assert sorted(p for lane in split for p in lane) == sorted(points)
    for lane in split:
        keys_in_order = [key for _, key, _ in lane]
        runs = [
            key for position, key in enumerate(keys_in_order) if position == 0 or keys_in_order[position - 1] != key
        ]
        assert len(runs) == len(set(runs)), keys_in_order  # a key's points side by side
    for key in {key for _, key, _ in points}:
        holding = [lane for lane in split if any(k == key for _, k, _ in lane)]
        assert len(holding) == 1
        assert [i for i, k, _ in holding[0] if k == key] == [i for i, k, _ in points if k == key]
    biggest_key = max((sum(1 for _, k, _ in points if k == key) for key in {k for _, k, _ in points}), default=0)
    sizes = [len(lane) for lane in split]
    assert max(sizes) - min(sizes) <= biggest_key, sizes


def test_the_limits_are_mlflows() -> None:
    from mlflow.utils.validation import MAX_BATCH_LOG_REQUEST_SIZE, MAX_METRICS_PER_BATCH

    assert mlflow_bridge.BATCH_LIMITS.points == MAX_METRICS_PER_BATCH
    assert mlflow_bridge.BATCH_LIMITS.bytes <= MAX_BATCH_LOG_REQUEST_SIZE


def test_queued_steps_go_together_in_requests_of_up_to_a_thousand_metrics() -> None:
    """Fifty 200-metric steps queued for a run still opening leave in one group of 10,000
    metrics, each of the four (balanced) lanes' 2,500 in three requests: 12 requests, against 200
    (four lanes a step) without grouping and 50 with one request a step."""
    client = FaultyMlflowClient([False], mlflow_bridge.BATCH_LIMITS)
    session = mlflow_bridge.MlflowSession(client, "run", "0", "http://127.0.0.1:9", "proj")
    sink = Sink("mlflow", SinkParts(metrics=mlflow_bridge.EXPORTERS.metrics(session)))
    root = Path(tempfile.mkdtemp(prefix="land-"))
    log = Spool(root / "mlflow.jsonl", {"sink": "mlflow"})
    writer = LogWriter({"mlflow": log})
    names = [f"actor/metric_{i}" for i in range(200)]
    for step in range(50):
        writer.append(["mlflow"], "step", StepBatch(RESOURCE, step, dict.fromkeys(names, float(step)), {}, step))
    writer.close()
    reader = LogReader(log.path, sink, Policy(), RESOURCE, follow=True)
    reader.start()  # the tracker opened: every step waits in its log
    assert reader.drain(30.0, since=time.monotonic()) == "drained"
    count_from_log(sink, writer)
    shutil.rmtree(root, ignore_errors=True)
    assert sink.stats.delivered == 50
    assert sorted(client.arrived) == sorted((k, s, float(s)) for s in range(50) for k in names)
    assert len(client.requests) == 12 and max(client.requests) <= 1000, client.requests


def test_a_tracker_without_a_bulk_path_stops_at_its_first_failure_so_steps_stay_in_order() -> None:
    """wandb, SwanLab, ClearML and Trackio take one step per call (``TrackerSession.write_steps``'s
    default): after a step the backend did not take, the later ones are not tried, so that its
    retry does not land it after them."""
    from otel_tracking.exporters._base import StepRecord, TrackerSession

    class OneStepAtATime(TrackerSession):
        def __init__(self) -> None:
            self.taken: list[int] = []
            self.failed_once: set[int] = set()

        @classmethod
        def open(cls, context: Any) -> TrackerSession:
            return cls()

        def write_step(self, record: StepRecord) -> bool:
            if record.step == 2 and 2 not in self.failed_once:
                self.failed_once.add(2)
                return False
            self.taken.append(record.step)
            return True

        def write_timing(self, step: int, key: str, seconds: float) -> bool:
            return True

        def finish(self, exit_code: int = 0) -> None:
            return None

    session = OneStepAtATime()
    records = [StepRecord(step=s, scalars={"x": float(s)}) for s in range(5)]
    rests = session.write_steps(records)
    assert rests == [None, None, records[2], records[3], records[4]]
    assert session.write_steps(records[2:]) == [None, None, None]
    assert session.taken == [0, 1, 2, 3, 4]
