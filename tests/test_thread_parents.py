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
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_tracking import Tracking, trace_state
from otel_tracking.cli.timeline import read_spans, select_steps, stragglers
from otel_tracking.exporters.file import read_anatomy
from otel_tracking.runtime.thread_parents import ThreadParents


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


# --- the bookkeeping against a model ----------------------------------------------------------------

# (thread, how): "top" opens with no current span (a pool thread asks for a parent first), "in"
# nests under the thread's innermost open phase, "beside" under that phase's parent (a concurrent
# asyncio task), "close" ends the thread's innermost open phase.
ops = st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["top", "in", "beside", "close"])), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_parent_given_is_the_innermost_phase_of_the_one_other_thread_inside_phases(
    program: list[tuple[int, str]],
) -> None:
    """Threads 0 and 1 are the application's, 2 and 3 pool threads.  A pool thread is given a
    parent only when exactly one other thread owns open phases; the parent is open, of that thread,
    and, when that thread's phases form one chain, its innermost; nothing is kept once all ended."""
    parents = ThreadParents()
    stacks: dict[int, list[tuple[object, object | None, Any]]] = {t: [] for t in range(4)}  # (span, parent, entry)
    helper: dict[int, bool] = {}
    count = 0
    for thread, how in program:
        stack = stacks[thread]
        if how == "close":
            if stack:
                _, _, entry = stack.pop()
                if entry is not None:
                    parents.closed(entry)
                if not stack:
                    helper.pop(thread, None)
            continue
        count += 1
        span = f"span{count}"
        current: object | None = None
        if how == "in" and stack:
            current = stack[-1][0]
        elif how == "beside" and stack:
            current = stack[-1][1]
        adopted = None
        if current is None and not stack and thread >= 2:
            owners = {t for t, s in stacks.items() if s and t != thread and not helper.get(t)}
            adopted = parents.parent_for(thread, span)
            if len(owners) != 1:
                assert adopted is None
            else:
                (owner,) = owners
                open_there = [s for s, _, _ in stacks[owner]]
                assert adopted is None or adopted in open_there
                chain = all(p == (open_there[i - 1] if i else p) for i, (_, p, _) in enumerate(stacks[owner]))
                top_level = [s for s, p, _ in stacks[owner] if p is None]
                if chain and len(top_level) == 1:
                    assert adopted == open_there[-1]
        entry = parents.opened(span, thread, current, adopted is not None)
        if adopted is not None:
            helper[thread] = True
        stack.append((span, current if current is not None else adopted, entry))
    for stack in stacks.values():
        while stack:
            _, _, entry = stack.pop()
            if entry is not None:
                parents.closed(entry)
    assert parents._threads == {} and parents._helpers == {}
