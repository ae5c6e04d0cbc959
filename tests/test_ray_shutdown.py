"""``ray.shutdown()`` right after the last call: the actors' spans must still arrive.

Ray gives an actor no exit: when the driver shuts down (or exits, or calls ``ray.kill``), the GCS
force-kills the actors it owned and their C++ core worker calls ``_exit`` within milliseconds, with
no exit hook, finalizer or signal handler sure to run (measured: docs/guides/distributed.md).  So
a ``traced`` call returns only after its spans have left the process.

The docs' own Ray example (docs/guides/distributed.md) runs here as its users run it: the code block,
unchanged, as a script in a process of its own, against a real OTLP/HTTP endpoint (``tests/otlp_receiver.py``), with its
``ray.shutdown()`` right after ``tracking.finish()``.  Before the fix it delivered the same 2-3 of 6
``update_actor`` spans every time, so it runs a few times.  The other tests drive the same wrapper
without Ray, in this process: the span has arrived (or is in the spool) the moment the call
returns, with no waiting, also when the endpoint refuses or hangs.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_tracking import trace_state, worker
from otel_tracking.delivery.spool import read_spool
from otel_tracking.distributed.ray_tracing import traced
from tests.otlp_receiver import HttpReceiver, wait_for

REPO = Path(__file__).resolve().parents[1]
RUNS = 3  # the loss was deterministic: a few runs show the fix is not luck


def readme_example() -> str:
    """The Python block of the docs' *Distributed runs* page (docs/guides/distributed.md), as written."""
    text = (REPO / "docs" / "guides" / "distributed.md").read_text()
    section = text[text.index("# Distributed runs") :]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "the docs' Ray example"
    code = found.group(1)
    assert code.rstrip().endswith("tracking.finish()\nray.shutdown()"), "the example ends the cluster at once"
    return code


def test_readme_ray_example_delivers_every_actor_span_through_ray_shutdown(isolated: Path) -> None:
    script = isolated / "example.py"
    script.write_text(readme_example())
    with HttpReceiver() as receiver:
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "PYTHONPATH": str(REPO),  # the actors' worker processes import otel_tracking from here too
        }
        run_ids = []
        for attempt in range(RUNS):
            done = subprocess.run(
                [sys.executable, str(script)], env=env, cwd=isolated, capture_output=True, text=True, timeout=600
            )
            assert done.returncode == 0, done.stderr[-4000:]
            # the file sink's run.json names the run: the spans of this attempt carry its id
            run_ids.append(_last_run_id(receiver, run_ids))
            spans = _spans_of(receiver, run_ids[-1])
            _assert_step_traces(spans, attempt)


def _last_run_id(receiver: HttpReceiver, seen: list[str]) -> str:
    def new_driver_run() -> str | None:
        ids = {s["resource"]["ml.run.id"] for s in receiver.received.spans() if s["name"] == "ml.step"}
        fresh = ids - set(seen)
        return fresh.pop() if len(fresh) == 1 else None

    return str(wait_for(new_driver_run, timeout_s=60, what="the driver's step spans of this run"))


def _spans_of(receiver: HttpReceiver, run_id: str) -> list[dict[str, Any]]:
    def all_six() -> list[dict[str, Any]] | None:
        spans = [s for s in receiver.received.spans() if s["resource"]["ml.run.id"] == run_id]
        return spans if sum(s["name"] == "update_actor" for s in spans) >= 6 else None

    # The script has exited; the spans either arrived before its calls returned or never will: the
    # deadline is only for a slow machine's receiver threads.
    return list(wait_for(all_six, timeout_s=60, what="all 6 update_actor spans"))


def _assert_step_traces(spans: list[dict[str, Any]], attempt: int) -> None:
    by_id = {s["span_id"]: s for s in spans}
    names = sorted(s["name"] for s in spans)
    assert names == ["ml.step"] * 3 + ["update_actor"] * 6 + ["update_actor_dispatch"] * 3, (attempt, names)
    roots = {s["attributes"]["ml.step"]: s for s in spans if s["name"] == "ml.step"}
    assert sorted(roots) == [1, 2, 3]
    driver_pid = roots[1]["resource"]["process.pid"]
    for step, root in roots.items():
        trace = [s for s in spans if s["trace_id"] == root["trace_id"]]
        (dispatch,) = [s for s in trace if s["name"] == "update_actor_dispatch"]
        assert dispatch["parent_span_id"] == root["span_id"]
        updates = [s for s in trace if s["name"] == "update_actor"]
        assert len(updates) == 2, (attempt, step, "both ranks' update_actor in this step's trace")
        for span in updates:
            assert by_id[span["parent_span_id"]] is dispatch
            resource = span["resource"]
            assert resource["ml.role"] == "ActorWorker" and resource["process.pid"] != driver_pid
            # ml.rank from the actor's own `rank` attribute, the one its lane names
            assert span["attributes"]["ml.lane"] == f"rank_{resource['ml.rank']}"
        assert sorted(s["resource"]["ml.rank"] for s in updates) == [0, 1]


# --- the same wrapper without Ray: at return, the span has left ------------------------------------


@pytest.fixture
def fresh_worker_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process plays a worker: its worker run and the actor it saw are this test's only."""
    monkeypatch.setattr(worker, "_defaults", {})
    monkeypatch.setattr(worker, "_actor", None)
    monkeypatch.setattr(worker, "_stalled_until", 0.0)
    monkeypatch.setattr(worker, "_warned_stall", False)
    yield


class Actor:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def update(self, batch: int) -> int:
        with trace_state("update_actor", state_lane_id=f"rank_{self.rank}"):
            return batch * 2

    async def generate(self, request: int) -> int:
        with trace_state("generate"):
            return request

    def stream(self, n: int) -> Iterator[int]:
        for i in range(n):
            with trace_state("chunk"):
                yield i


TracedActor = traced(Actor)


def test_a_traced_call_returns_after_its_spans_arrived(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, fresh_worker_state: None
) -> None:
    import asyncio

    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        actor = TracedActor(3)
        for batch in range(3):
            assert actor.update(batch) == 2 * batch
            # no waiting: the call returned, so its span is at the endpoint
            assert [s["name"] for s in receiver.received.spans()] == ["update_actor"] * (batch + 1)
        assert asyncio.run(actor.generate(7)) == 7
        assert sum(s["name"] == "generate" for s in receiver.received.spans()) == 1
        assert list(actor.stream(2)) == [0, 1]
        assert sum(s["name"] == "chunk" for s in receiver.received.spans()) == 2
        resources = {s["resource"]["ml.rank"] for s in receiver.received.spans()}
        assert resources == {3}, "ml.rank: the actor's rank attribute"


def test_rank_configured_or_from_the_environment_wins_over_the_actor_attribute(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, fresh_worker_state: None
) -> None:
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("RANK", "5")
        TracedActor(3).update(1)
        (span,) = receiver.received.spans()
        assert span["resource"]["ml.rank"] == 5


def test_a_refusing_endpoint_has_the_span_in_the_spool_when_the_call_returns(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, fresh_worker_state: None
) -> None:
    with HttpReceiver() as receiver:
        receiver.received.unavailable = True  # 503 to every request: retried, then spooled
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        TracedActor(0).update(1)
        (spool,) = (isolated / "spool").rglob("otlp-traces*.jsonl")
        _, records = read_spool(spool)
        kept = [span.name for record in records if record[0] == "spans" for span in record[1]]
        assert kept == ["update_actor"] and receiver.received.refused["traces"] >= 1


class HungEndpoint:
    """Accepts connections and never answers (a collector stuck on a full disk)."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.socket.accept()
            except OSError:
                return
            self.accepted.append(conn)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.socket.getsockname()[1]}"

    def close(self) -> None:
        self.socket.close()
        for conn in self.accepted:
            conn.close()


def test_a_hung_endpoint_costs_one_bounded_wait_and_one_warning(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, fresh_worker_state: None, caplog: pytest.LogCaptureFixture
) -> None:
    hung = HungEndpoint()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", hung.endpoint)
        monkeypatch.setenv("OTEL_TRACKING_FINISH_TIMEOUT", "1")  # the teardown's finish() spools what hangs
        waits: list[float] = []
        real_flush = worker.Run.flush

        def flush(run: Any, timeout_s: float = 30.0) -> bool:
            waits.append(timeout_s)
            return real_flush(run, timeout_s)

        monkeypatch.setattr(worker.Run, "flush", flush)
        monkeypatch.setattr(worker, "RETURN_TIMEOUT_S", 0.5)
        actor = TracedActor(0)
        with caplog.at_level(logging.WARNING, logger="otel_tracking"):
            for batch in range(3):
                assert actor.update(batch) == 2 * batch
            # the first call waited (and gave up), the later ones only looked
            assert [w for w in waits if w > 0] == [0.5]
            worker._stalled_until = time.monotonic() - 1.0  # STALL_PAUSE_S later: calls wait again
            actor.update(3)
            assert [w for w in waits if w > 0] == [0.5, 0.5]
        stalled = [r for r in caplog.records if "did not leave within" in r.getMessage()]
        assert len(stalled) == 1, "one warning per process"
    finally:
        hung.close()
