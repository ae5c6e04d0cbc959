"""One trace per step, whose root encloses its children (``runtime/step_roots.py``), read back
from the file sink's events file.

The model test drives random programs of ``trace_state`` opens (labelled with the step just
logged, with another step, or not at all), closes and ``log()`` calls, and checks the spans that
arrived against a model of where each top-level span must hang: every trace has one root, the
root encloses every span of its trace in time, and the traces group the spans as the model says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_tracking import Tracking, trace_state


def events(root: Path) -> list[dict[str, Any]]:
    path = root / "proj" / "exp.events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []  # made with the first span
    return [event for event in map(json.loads, lines) if event["type"] == "span"]


def test_a_log_inside_validate_keeps_one_trace_per_step_and_the_root_encloses_it(isolated: Path) -> None:
    """The demo's shape: the step's phases, its log(), then validate (step=N) with a log() inside."""
    tracking = Tracking("proj", "exp", default_backend="file")
    for step in (1, 2):
        with trace_state("rollout"):
            pass
        tracking.log({"loss": 0.5}, step=step)
        with trace_state("validate", step=step):
            tracking.log({"val/score": 0.7}, step=step)
            with trace_state("score"):
                pass
    tracking.finish()
    spans = events(isolated)
    roots = [s for s in spans if s["name"] == "ml.step"]
    assert [r["attributes"]["ml.step"] for r in roots] == [1, 2]
    for root in roots:
        in_trace = [s for s in spans if s["trace_id"] == root["trace_id"] and s is not root]
        assert sorted(s["name"] for s in in_trace) == ["rollout", "score", "validate"]
        for span in in_trace:
            assert root["start_time_unix_nano"] <= span["start_time_unix_nano"]
            assert span["end_time_unix_nano"] <= root["end_time_unix_nano"], f"{span['name']} outlives its root"


def test_the_first_steps_phases_are_not_stamped_step_0(isolated: Path) -> None:
    """Before the first log() the step is unknown: the phases carry no ml.step (their root says
    it), not 0; after it, the step in progress is the last one + 1."""
    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("rollout"):
        pass
    tracking.log({"loss": 0.5}, step=1)
    with trace_state("rollout"):
        pass
    tracking.log({"loss": 0.4}, step=2)
    tracking.finish()
    by_trace: dict[str, dict[str, Any]] = {}
    for span in events(isolated):
        by_trace.setdefault(span["trace_id"], {})[span["name"]] = span
    first, second = by_trace.values()
    assert first["ml.step"]["attributes"]["ml.step"] == 1
    assert "ml.step" not in first["rollout"]["attributes"]
    assert second["rollout"]["attributes"]["ml.step"] == second["ml.step"]["attributes"]["ml.step"] == 2


# --- the model ------------------------------------------------------------------------------------

op = st.one_of(
    st.tuples(st.just("open"), st.sampled_from([None, "logged", "other"])),
    st.just(("close",)),
    st.tuples(st.just("log"), st.sampled_from(["same", "next"])),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=st.lists(op, max_size=25))
def test_traces_group_the_spans_as_the_model_says(program: list[tuple[Any, ...]], isolated: Path) -> None:
    events_file = isolated / "proj" / "exp.events.jsonl"
    if events_file.exists():
        events_file.unlink()
    tracking = Tracking("proj", "exp", default_backend="file")
    stack: list[tuple[str, trace_state]] = []  # the open spans, innermost last
    last_step, count = 0, 0
    # The model: which root (a number) each span hangs under, and the root spans open now.
    root_of: dict[str, int] = {}
    current: dict[str, Any] | None = None  # the step in progress's root: its id, the step that closed it
    roots = 0
    for action in program:
        if action[0] == "open":
            name = f"s{count}"
            count += 1
            label = {None: None, "logged": last_step, "other": last_step + 7}[action[1]]
            if stack:
                root_of[name] = root_of[stack[-1][0]]  # nested: its parent's trace
            else:
                if current is not None and current["closed_by"] is not None and label != current["closed_by"]:
                    current = None  # the next step has begun
                if current is None:
                    roots += 1
                    current = {"id": roots, "closed_by": None}
                root_of[name] = current["id"]
            state = trace_state(name) if label is None else trace_state(name, step=label)
            state.__enter__()
            stack.append((name, state))
        elif action[0] == "close":
            if stack:
                stack.pop()[1].__exit__(None, None, None)
        else:
            step = last_step if action[1] == "same" else last_step + 1
            tracking.log({"x": 1}, step=step)
            if current is not None:
                if current["closed_by"] is not None and current["closed_by"] != step:
                    current = None  # a step with no span of its own
                else:
                    current["closed_by"] = step
            last_step = step
    while stack:
        stack.pop()[1].__exit__(None, None, None)
    tracking.finish()
    spans = events(isolated)
    by_name = {s["name"]: s for s in spans if s["name"] != "ml.step"}
    root_spans = [s for s in spans if s["name"] == "ml.step"]
    assert set(by_name) == set(root_of)
    assert len(root_spans) == roots
    model_groups = sorted(sorted(k for k, v in root_of.items() if v == r) for r in set(root_of.values()))
    trace_groups: dict[str, list[str]] = {}
    for name, span in by_name.items():
        trace_groups.setdefault(span["trace_id"], []).append(name)
    assert sorted(sorted(g) for g in trace_groups.values()) == model_groups
    for root in root_spans:
        assert root["parent_span_id"] is None
        for span in (s for s in by_name.values() if s["trace_id"] == root["trace_id"]):
            assert root["start_time_unix_nano"] <= span["start_time_unix_nano"]
            assert span["end_time_unix_nano"] <= root["end_time_unix_nano"], f"{span['name']} outlives its root"


@pytest.mark.backend
def test_a_tracker_gets_the_first_steps_timings_at_step_1(isolated: Path) -> None:
    """TensorBoard, read back through its own reader: the first step's phase timings at the step
    its log() said (the root's), not at 0."""
    from tests.test_backend_tensorboard import read_events

    tracking = Tracking("proj", "exp", default_backend=["tensorboard"])
    for step in (1, 2):
        with trace_state("rollout"):
            pass
        tracking.log({"loss": 1.0 / step}, step=step)
    tracking.finish()
    scalars, _, _ = read_events(isolated / "tensorboard_log" / "proj" / "exp")
    assert [step for step, _ in scalars["timing_s/state/rollout"]] == [1, 2]
    assert [step for step, _ in scalars["loss"]] == [1, 2]


def test_flush_delivers_a_logged_steps_root(isolated: Path) -> None:
    """flush() ends the root of a step already logged (what is done is delivered, not held for the
    next step's first phase); a span saying that step afterwards has a trace of its own."""
    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("rollout"):
        pass
    tracking.log({"loss": 0.5}, step=1)
    assert tracking.flush(30)
    assert [s["name"] for s in events(isolated)] == ["rollout", "ml.step"]
    with trace_state("late", step=1):
        pass
    tracking.finish()
    spans = events(isolated)
    late, rollout = (next(s for s in spans if s["name"] == name) for name in ("late", "rollout"))
    roots = [s for s in spans if s["name"] == "ml.step"]
    assert [r["trace_id"] for r in roots] == [rollout["trace_id"], late["trace_id"]]
    assert late["trace_id"] != rollout["trace_id"]
