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
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from otel_tracking import Tracking, trace_state


def events(root: Path, kind: str = "span") -> list[dict[str, Any]]:
    path = root / "proj" / "exp.events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []  # made with the first span
    return [event for event in map(json.loads, lines) if event["type"] == kind]


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
# a step logged again after a phase without step= (one closed, one still open at the log())
@example(program=[("log", "next"), ("open", None), ("close",), ("log", "same"), ("open", None), ("log", "same")])
def test_traces_group_the_spans_as_the_model_says(program: list[tuple[Any, ...]], isolated: Path) -> None:
    events_file = isolated / "proj" / "exp.events.jsonl"
    if events_file.exists():
        events_file.unlink()
    tracking = Tracking("proj", "exp", default_backend="file")
    stack: list[tuple[str, trace_state]] = []  # the open spans, innermost last
    last_step, count = 0, 0
    # The model: which root (a number) each span hangs under, and the root spans open now.
    root_of: dict[str, int] = {}
    # the step in progress's root: its id, the step that closed it, and (a root opened by a span
    # without step= after a log()) the root whose step the next log() may say again
    current: dict[str, Any] | None = None
    roots = opened = 0
    for action in program:
        if action[0] == "open":
            name = f"s{count}"
            count += 1
            label = {None: None, "logged": last_step, "other": last_step + 7}[action[1]]
            if stack:
                root_of[name] = root_of[stack[-1][0]]  # nested: its parent's trace
            else:
                awaits = None
                if current is not None and current["closed_by"] is not None and label != current["closed_by"]:
                    awaits = current if label is None else None  # the same step again, or the next one
                    current = None
                if current is None:
                    roots, opened = roots + 1, opened + 1
                    current = {"id": opened, "closed_by": None, "awaits": awaits}
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
            awaited = current and current["awaits"]
            if current is not None and awaited is not None:
                current["awaits"] = None
                if awaited["closed_by"] == step:  # logged again: one trace, under the step's first root
                    root_of.update({k: awaited["id"] for k, v in root_of.items() if v == current["id"]})
                    roots -= 1
                    current = awaited
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


def _train_validate_gen(tracking: Tracking, step: int, in_validate: Any = None) -> None:
    """Train values, an unlabelled ``validate`` (with a phase of its own), the validation values
    at the same step, then the next step's phase and values."""
    with trace_state("train"):
        with trace_state("forward"):
            pass
    tracking.log({"loss": 1.0}, step=step)
    with trace_state("validate"):
        with trace_state("score"):
            if in_validate is not None:
                in_validate()
    tracking.log({"val/acc": 0.9}, step=step)
    with trace_state("gen"):
        pass
    tracking.log({"loss": 0.5}, step=step + 1)


def _by_trace(spans: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for span in spans:
        found.setdefault(span["trace_id"], {})[span["name"]] = span
    return found


def test_a_step_logged_twice_is_one_trace_under_one_root(isolated: Path) -> None:
    """validate, begun after the step's first log() without step=, joins the step's trace once the
    next log() says the step again: one root, validate under it, its own phase under validate
    (and the generations it logged); the next step's phase has a trace of its own."""
    from otel_tracking import ValidationGenerationsLogger

    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("gen"):
        pass
    tracking.log({"loss": 2.0}, step=1)  # step 2's phases below open after a log(), as every step's do
    _train_validate_gen(tracking, 2, lambda: ValidationGenerationsLogger().log("file", [("2+2?", "4", 1.0)], 2))
    tracking.finish()
    traces = list(_by_trace(events(isolated)).values())
    assert [sorted(t) for t in traces] == [
        ["gen", "ml.step"],
        ["forward", "ml.step", "score", "train", "validate"],
        ["gen", "ml.step"],
    ]
    step = traces[1]
    root = step["ml.step"]
    assert root["attributes"]["ml.step"] == 2 and "ml.step.continues" not in root["attributes"]
    assert not root.get("links")
    assert step["train"]["parent_span_id"] == step["validate"]["parent_span_id"] == root["span_id"]
    assert step["score"]["parent_span_id"] == step["validate"]["span_id"]
    assert step["forward"]["parent_span_id"] == step["train"]["span_id"]
    # the step they served, and a root that encloses them
    assert {s["attributes"]["ml.step"] for s in step.values()} == {2}
    assert root["end_time_unix_nano"] >= step["validate"]["end_time_unix_nano"]
    assert traces[2]["gen"]["attributes"]["ml.step"] == traces[2]["ml.step"]["attributes"]["ml.step"] == 3
    (generations,) = [r for r in events(isolated, "log") if r["event_name"] == "ml.validation.generations"]
    assert (generations["trace_id"], generations["span_id"]) == (root["trace_id"], step["score"]["span_id"])


def _second_root_links_to_the_first(traces: list[dict[str, dict[str, Any]]]) -> None:
    """The fallback: validate keeps a trace of its own, whose root says the step and is marked
    ``ml.step.continues`` (its link to the first root: the file sink writes no links)."""
    first, second = traces[1]["ml.step"], traces[2]["ml.step"]
    assert sorted(traces[1]) == ["forward", "ml.step", "train"]
    assert "validate" in traces[2]
    assert first["attributes"]["ml.step"] == second["attributes"]["ml.step"] == 2
    assert second["attributes"]["ml.step.continues"] is True


def test_a_carrier_taken_in_validate_keeps_its_trace_and_the_link(isolated: Path) -> None:
    """Another process's spans cannot be moved: a carrier taken under validate keeps validate's
    trace id, and the step's second root links to its first."""
    from otel_tracking.propagation import inject

    carriers: list[dict[str, str]] = []
    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("gen"):
        pass
    tracking.log({"loss": 2.0}, step=1)
    _train_validate_gen(tracking, 2, in_validate=lambda: carriers.append(inject()))
    tracking.finish()
    traces = list(_by_trace(events(isolated)).values())
    _second_root_links_to_the_first(traces)
    (carrier,) = carriers
    assert carrier["traceparent"].split("-")[1] == traces[2]["validate"]["trace_id"]
    assert carrier["traceparent"].split("-")[2] == traces[2]["score"]["span_id"]


def test_what_is_held_is_bounded(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_HELD spans a tentative trace goes out as it is (the link instead of one trace)."""
    from otel_tracking.runtime import held_spans

    monkeypatch.setattr(held_spans, "MAX_HELD", 3)
    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("gen"):
        pass
    tracking.log({"loss": 2.0}, step=1)

    def many() -> None:
        for _ in range(held_spans.MAX_HELD + 1):
            with trace_state("sample"):
                pass

    _train_validate_gen(tracking, 2, in_validate=many)
    tracking.finish()
    _second_root_links_to_the_first(list(_by_trace(events(isolated)).values()))


def test_flush_delivers_a_tentative_steps_spans(isolated: Path) -> None:
    """flush() while a phase begun after a log() may still be that step's: what ended is
    delivered as it is; the step's second root then links to its first."""
    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("gen"):
        pass
    tracking.log({"loss": 2.0}, step=1)
    with trace_state("train"):
        with trace_state("forward"):
            pass
    tracking.log({"loss": 1.0}, step=2)
    with trace_state("validate"):
        with trace_state("score"):
            pass
        assert tracking.flush(30)
        assert "score" in [s["name"] for s in events(isolated)]
    tracking.log({"val/acc": 0.9}, step=2)
    tracking.finish()
    _second_root_links_to_the_first(list(_by_trace(events(isolated)).values()))


def test_otlp_gets_the_step_logged_twice_as_one_trace(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a trace UI (Jaeger, Tempo, Zipkin) receives over OTLP: the same one trace."""
    from tests.otlp_receiver import HttpReceiver, wait_for

    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("proj", "exp", default_backend="console")
        with trace_state("gen"):
            pass
        tracking.log({"loss": 2.0}, step=1)
        _train_validate_gen(tracking, 2)
        tracking.finish()
        spans = wait_for(lambda: len(receiver.received.spans()) >= 9 and receiver.received.spans(), what="spans")
    traces = _by_trace(spans)
    (step,) = (t for t in traces.values() if "validate" in t)
    assert sorted(step) == ["forward", "ml.step", "score", "train", "validate"]
    root = step["ml.step"]
    assert root["attributes"]["ml.step"] == 2 and not root["links"]
    assert step["validate"]["parent_span_id"] == step["train"]["parent_span_id"] == root["span_id"]
    assert len(traces) == 3 and sum(len(t) for t in traces.values()) == len(spans) == 9


def test_a_carrier_taken_after_the_step_was_logged_again_names_the_steps_trace(isolated: Path) -> None:
    """validate still open when the step is logged again: it joins the step's trace as it ends, and
    a carrier taken in it afterwards names that trace (and validate), so another process's spans
    hang under validate there."""
    from otel_tracking.propagation import inject

    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("gen"):
        pass
    tracking.log({"loss": 2.0}, step=1)
    with trace_state("train"):
        pass
    tracking.log({"loss": 1.0}, step=2)
    with trace_state("validate"):
        tracking.log({"val/acc": 0.9}, step=2)
        carrier = inject()
        with trace_state("score"):
            pass
    tracking.log({"loss": 0.5}, step=3)
    tracking.finish()
    (step,) = (t for t in _by_trace(events(isolated)).values() if "train" in t)
    assert sorted(step) == ["ml.step", "score", "train", "validate"]
    assert step["validate"]["parent_span_id"] == step["ml.step"]["span_id"]
    _, trace_id, span_id, _ = carrier["traceparent"].split("-")
    assert (trace_id, span_id) == (step["validate"]["trace_id"], step["validate"]["span_id"])


def test_a_stall_report_sends_what_ended_of_a_held_step(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase stuck after the step's log(): its finished children reach the sinks with the stall
    report, not at a log() that may never come."""
    from tests.otlp_receiver import wait_for

    monkeypatch.setenv("OTEL_TRACKING_STALL_AFTER", "1")
    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("gen"):
        pass
    tracking.log({"loss": 2.0}, step=1)
    with trace_state("validate"):  # stuck
        with trace_state("score"):
            pass
        wait_for(lambda: "score" in [s["name"] for s in events(isolated)], what="the stuck step's finished phase")
    tracking.finish()
