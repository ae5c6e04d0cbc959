"""A phase is the parent of the lanes it hands to a thread pool or to asyncio tasks, written the
natural way (``pool.map``, ``run_in_executor``, ``gather``), read back from the file sink: the
lanes hang under the phase, the anatomy names the phase's straggler lane, and so does the timeline.
Where the parent cannot be told (phases open in two other threads), the lane hangs under the step's
root and one warning says how to make it right."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from otel_tracking import Tracking, trace_state
from otel_tracking.cli.timeline import read_spans, select_steps, stragglers
from otel_tracking.exporters.file import read_anatomy


def _busy(at_least_ns: int) -> None:
    """Work (not a sleep) for at least ``at_least_ns``: the lane that does more is the straggler."""
    start = time.perf_counter_ns()
    while time.perf_counter_ns() - start < at_least_ns:
        pass


def generate(lane: int) -> int:
    with trace_state("generate", state_lane_id=lane):
        with trace_state("tokenize"):  # nested in the lane: still the lane's, not a parent for others
            pass
        _busy(30_000_000 if lane == 2 else 1_000_000)
    return lane


def _spans(root: Path) -> list[dict[str, Any]]:
    lines = (root / "proj" / "exp.events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["type"] == "span"]


def _check_lanes_hang_under_rollout(root: Path, steps: int) -> None:
    spans = _spans(root)
    by_id = {s["span_id"]: s for s in spans}
    lanes = [s for s in spans if s["name"] == "generate"]
    assert len(lanes) == 3 * steps
    for lane in lanes:
        assert by_id[lane["parent_span_id"]]["name"] == "rollout", lane
        assert lane["attributes"].get("ml.step") == by_id[lane["parent_span_id"]]["attributes"].get("ml.step")
    for tokenize in (s for s in spans if s["name"] == "tokenize"):
        assert by_id[tokenize["parent_span_id"]]["name"] == "generate"
    anatomy = read_anatomy(root / "proj" / "exp.jsonl")
    assert sorted(anatomy) == list(range(1, steps + 1))
    for data in anatomy.values():
        assert data["anatomy/rollout/straggler_rank"] == 2, data
    drawn = stragglers(select_steps(read_spans([root / "proj" / "exp.events.jsonl"]), 1, steps))
    assert [(f.phase, f.lane[1]) for f in drawn] == [("rollout", "2")] * steps, drawn


def test_pool_map_inside_a_phase_hangs_the_lanes_under_it(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACKING_ANATOMY", "1")
    tracking = Tracking("proj", "exp", default_backend="file")
    with ThreadPoolExecutor(3) as pool:
        for step in (1, 2):
            with trace_state("rollout"):
                assert sorted(pool.map(generate, range(3))) == [0, 1, 2]
            tracking.log({"loss": 1.0 / step}, step)
    tracking.finish()
    _check_lanes_hang_under_rollout(isolated, 2)


def test_asyncio_tasks_and_run_in_executor_hang_the_lanes_under_the_phase(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tasks copy their creator's context (asyncio does that); run_in_executor's threads do not,
    and are given the phase as their parent."""
    monkeypatch.setenv("OTEL_TRACKING_ANATOMY", "1")

    async def lane_task(lane: int) -> None:
        await asyncio.get_running_loop().run_in_executor(None, generate, lane)

    async def a_step() -> None:
        with trace_state("rollout"):
            await asyncio.gather(*(lane_task(lane) for lane in range(3)))

    tracking = Tracking("proj", "exp", default_backend="file")
    for step in (1, 2):
        asyncio.run(a_step())
        tracking.log({"loss": 1.0 / step}, step)
    tracking.finish()
    _check_lanes_hang_under_rollout(isolated, 2)


def test_a_lane_whose_phase_cannot_be_told_hangs_under_the_step_and_says_so_once(
    isolated: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two threads of the application inside a phase each (neither hangs under the other's): a pool
    thread's phase could belong to either."""
    tracking = Tracking("proj", "exp", default_backend="file")
    inside, done = threading.Barrier(3), threading.Event()

    def trainer(name: str) -> None:
        with trace_state(name):
            inside.wait(timeout=30)
            done.wait(timeout=30)

    threads = [threading.Thread(target=trainer, args=(name,)) for name in ("left", "right")]
    for thread in threads:
        thread.start()
    inside.wait(timeout=30)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(generate, 0).result()
        pool.submit(generate, 1).result()
    done.set()
    for thread in threads:
        thread.join(timeout=30)
    tracking.log({"loss": 1.0}, 1)
    tracking.finish()
    said = [r.getMessage() for r in caplog.records if "cannot tell which one" in r.getMessage()]
    assert len(said) == 1 and "copy_context" in said[0], said
    spans = _spans(isolated)
    by_id = {s["span_id"]: s for s in spans}
    for lane in (s for s in spans if s["name"] in ("generate", "left", "right")):
        assert by_id[lane["parent_span_id"]]["name"] == "ml.step", lane  # a thread of its own is never adopted
