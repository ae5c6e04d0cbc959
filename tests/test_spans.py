"""trace_state: the span tree, lanes and labels, across threads and asyncio tasks, read back from
the file sink's events file."""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
from pathlib import Path

import pytest

from otel_tracking import Tracking, trace_state


def spans(root: Path, steps: bool = False) -> list[dict]:
    """The spans in the file sink's events file; the driver's per-step root spans only if asked."""
    lines = (root / "proj" / "exp.events.jsonl").read_text().splitlines()
    found = [event for event in map(json.loads, lines) if event["type"] == "span"]
    return found if steps else [span for span in found if span["name"] != "ml.step"]


def test_nesting_lane_labels_and_step(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")
    tracking.log({"x": 1}, 7)
    with trace_state("step"):
        with trace_state("rollout", state_lane_id="worker-3", model="actor", temperature=0.7):
            pass
        with trace_state("update", step=42):
            pass
    tracking.finish()
    by_name = {span["name"]: span for span in spans(isolated, steps=True)}
    assert by_name["rollout"]["parent_span_id"] == by_name["step"]["span_id"]
    assert by_name["update"]["parent_span_id"] == by_name["step"]["span_id"]
    # Outside any span, a driver's phase hangs under the step's root span (one trace per step).
    root = by_name["ml.step"]
    assert root["parent_span_id"] is None
    assert by_name["step"]["parent_span_id"] == root["span_id"]
    assert by_name["step"]["trace_id"] == by_name["update"]["trace_id"] == root["trace_id"]
    assert root["attributes"] == {"ml.step": 8, "ml.span.ended_by": "finish"}
    assert by_name["rollout"]["attributes"] == {
        "ml.lane": "worker-3",
        "ml.label.model": "actor",
        "ml.label.temperature": 0.7,
        "ml.step": 8,
    }
    assert by_name["update"]["attributes"]["ml.step"] == 42
    assert by_name["rollout"]["duration_s"] >= 0


def test_decorator_sync_and_async_and_errors(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")

    @trace_state("reward", state_lane_id=0)
    def reward(x: int) -> int:
        return x * 2

    @trace_state("generate", state_lane_id=1)
    async def generate(x: int) -> int:
        await asyncio.sleep(0)
        return x + 1

    assert reward(3) == 6
    assert reward(4) == 8
    assert asyncio.run(generate(1)) == 2
    with pytest.raises(KeyError), trace_state("failing"):
        raise KeyError("boom")
    tracking.finish()
    got = spans(isolated)
    assert [s["name"] for s in got] == ["reward", "reward", "generate", "failing"]
    assert len({s["span_id"] for s in got}) == 4, "each call is its own span"
    assert got[3]["status"] == "ERROR"
    assert got[3]["events"][0]["name"] == "exception"


def test_threads_keep_their_own_nesting(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")
    barrier = threading.Barrier(8)

    def worker(lane: int) -> None:
        with trace_state("rollout", state_lane_id=lane):
            barrier.wait()  # all eight are open at once
            for _ in range(5):
                with trace_state("generate", state_lane_id=lane):
                    pass

    threads = [threading.Thread(target=worker, args=(lane,)) for lane in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracking.finish()
    got = spans(isolated)
    parents = {s["span_id"]: s for s in got if s["name"] == "rollout"}
    children = [s for s in got if s["name"] == "generate"]
    assert len(parents) == 8 and len(children) == 40
    for child in children:
        parent = parents[child["parent_span_id"]]
        assert parent["attributes"]["ml.lane"] == child["attributes"]["ml.lane"], "lanes never mix"


def test_thousand_concurrent_coroutines_lose_nothing_and_mix_no_lanes(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")

    async def one(lane: int) -> None:
        async with trace_state("request", state_lane_id=lane):
            await asyncio.sleep(0.001)
            with trace_state("decode", state_lane_id=lane):
                await asyncio.sleep(0)

    async def main() -> None:
        with trace_state("rollout"):
            await asyncio.gather(*(one(lane) for lane in range(1000)))

    asyncio.run(main())
    tracking.finish()
    got = spans(isolated)
    (root,) = [s for s in got if s["name"] == "rollout"]
    requests = {s["span_id"]: s for s in got if s["name"] == "request"}
    decodes = [s for s in got if s["name"] == "decode"]
    assert len(requests) == 1000 and len(decodes) == 1000
    assert all(r["parent_span_id"] == root["span_id"] for r in requests.values())
    for decode in decodes:
        assert requests[decode["parent_span_id"]]["attributes"]["ml.lane"] == decode["attributes"]["ml.lane"]


def test_context_copied_into_a_worker_thread_nests(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")

    def child() -> None:
        with trace_state("generate"):
            pass

    with trace_state("rollout"):
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(child,))
        thread.start()
        thread.join()
    tracking.finish()
    by_name = {s["name"]: s for s in spans(isolated)}
    assert by_name["generate"]["parent_span_id"] == by_name["rollout"]["span_id"]


def test_without_a_tracking_spans_go_to_the_process_worker_run(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Tracking in this process (a worker): the spans are recorded by the process's worker run,
    here into the file sink named by OTEL_TRACES_EXPORTER, as context manager and decorator."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "ml.project=proj,ml.experiment=exp")
    with trace_state("orphan", state_lane_id=1):
        pass

    @trace_state("orphan-fn")
    def f() -> int:
        return 1

    assert f() == 1
    from otel_tracking.runtime.run import current_run

    run = current_run()
    assert run is not None and not run.driver
    run.finish()
    assert [(s["name"], s["parent_span_id"]) for s in spans(isolated)] == [("orphan", None), ("orphan-fn", None)]


def test_empty_state_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty state name"):
        trace_state("")


def test_a_span_still_open_at_finish_is_ended_and_delivered(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.otlp_receiver import HttpReceiver, wait_for

    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("proj", "exp", default_backend="file")
        with trace_state("fit"):
            with trace_state("epoch"):
                tracking.log({"loss": 0.5}, 1)
                stats = tracking.finish()  # inside both spans, as `with trace_state("fit"): ...` code does
        assert stats["otlp-traces"]["delivered"] == 3  # the step's root, epoch and fit: none left behind
        found = wait_for(lambda: len(receiver.received.spans()) == 3 and receiver.received.spans(), what="3 spans")
    by_name = {s["name"]: s for s in found}
    assert by_name["fit"]["attributes"]["ml.span.ended_by"] == "finish"
    assert by_name["epoch"]["attributes"]["ml.span.ended_by"] == "finish"
    assert by_name["epoch"]["parent_span_id"] == by_name["fit"]["span_id"]
    assert {s["name"] for s in spans(isolated, steps=True)} == {"ml.step", "fit", "epoch"}


def test_driver_spans_outside_a_run(isolated: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """Before ``Tracking()`` a process cannot know it is a driver: a span there goes to the process's
    worker run, which ``Tracking()`` then finishes (it stayed open beside the real run).  After
    ``finish()`` a span is not recorded, with one warning (it built a stray worker run, whose span
    was spooled with a "no trace exporter" warning). Issue 19, item 9."""
    import logging

    from otel_tracking.runtime import run as run_module

    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(isolated))
    with trace_state("before"):
        pass
    stray = run_module.current_run()
    assert stray is not None and stray.process_worker and not stray.finished
    tracking = Tracking("proj", "exp", default_backend=["file"])
    assert stray.finished, "Tracking() ended the worker run"
    assert [r for r in run_module._active_runs if not r.finished] == [tracking._run]
    (worker_spool,) = (isolated / "spool").rglob("otlp-traces.jsonl")  # the worker run's spans, as documented
    assert '"before"' in worker_spool.read_text()
    with trace_state("during"):
        pass
    tracking.log({"loss": 1.0}, 1)
    tracking.finish()
    caplog.set_level(logging.WARNING, logger="otel_tracking")
    with trace_state("after") as span:
        with trace_state("after-child"):
            pass
    assert not span.is_recording()
    with trace_state("after-again"):
        pass
    assert run_module.current_run() is None, "no stray worker run"
    said = [r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()]
    assert len(said) == 1 and "trace_state('after') after this process's Tracking run finished" in said[0]
    assert [s["name"] for s in spans(isolated)] == ["during"]
    assert [p.name for p in (isolated / "spool").rglob("*.jsonl")] == ["otlp-traces.jsonl"], "nothing spooled after"

    again = Tracking("proj", "exp2", default_backend=["file"])  # a new run records spans again
    with trace_state("next"):
        pass
    again.finish()
    lines = (isolated / "proj" / "exp2.events.jsonl").read_text().splitlines()
    assert [json.loads(line)["name"] for line in lines] == ["next", "ml.step"]
