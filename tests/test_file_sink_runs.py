"""One run, one pair of files; a new run never loses an earlier one's lines (issue 19, item 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otel_tracking import Tracking, trace_state


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run_ids(events: Path) -> set[str]:
    return {event["resource"]["ml.run.id"] for event in _lines(events)}


@pytest.fixture
def logs(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(isolated / "logs"))
    return isolated / "logs" / "p"


def test_each_new_run_moves_the_ended_runs_files_aside_both_of_them(logs: Path) -> None:
    """The metrics file was truncated by every run while the events file was appended to: after 5
    runs the events file held 5 run ids beside 1 metrics line."""
    run_ids = []
    for n in range(1, 5):
        tracking = Tracking("p", "a", default_backend=["file"])
        with trace_state("phase"):
            pass
        tracking.log({"run": float(n)}, 1)
        tracking.finish()
        run_ids.append(tracking.run_id)
    assert _lines(logs / "a.jsonl") == [{"step": 1, "data": {"run": 4.0}}]
    assert _run_ids(logs / "a.events.jsonl") == {run_ids[-1]}
    pairs = {}
    for metrics in logs.glob("a.*.jsonl"):
        if metrics.name.endswith(".events.jsonl"):
            continue
        events = metrics.with_name(metrics.name[: -len(".jsonl")] + ".events.jsonl")
        ((line,),) = [_lines(metrics)]
        pairs[line["data"]["run"]] = _run_ids(events)
    assert pairs == {1.0: {run_ids[0]}, 2.0: {run_ids[1]}, 3.0: {run_ids[2]}}, "each earlier run kept, whole"


def test_two_runs_at_once_write_two_pairs_of_files(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The second ``Tracking("p", "a")`` of a process truncated the first's file: its step 1 was
    gone, while its finish() said delivered 2."""
    first = Tracking("p", "a", default_backend=["file"])
    first.log({"x": 1.0}, 1)
    second = Tracking("p", "a", default_backend=["file"])
    second.log({"y": 1.0}, 1)
    first.log({"x": 2.0}, 2)
    with trace_state("phase"):  # the newest run records it
        pass
    second.log({"y": 2.0}, 2)
    assert first.finish()["file"]["delivered"] == 2
    second.finish()
    assert _lines(logs / "a.jsonl") == [{"step": 1, "data": {"x": 1.0}}, {"step": 2, "data": {"x": 2.0}}]
    own = logs / f"a.{second.run_id}.jsonl"
    assert _lines(own) == [{"step": 1, "data": {"y": 1.0}}, {"step": 2, "data": {"y": 2.0}}]
    assert _run_ids(logs / f"a.{second.run_id}.events.jsonl") == {second.run_id}
    assert not (logs / "a.events.jsonl").exists()
    assert f"Creating file logger at {own.resolve()}" in capsys.readouterr().out
    assert str(own.resolve()) in second.where()["file"]


def test_a_traces_only_file_sink_creates_no_metrics_file(logs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (logs).mkdir(parents=True)
    (logs / "a.jsonl").write_text('{"step":1,"data":{"kept":1.0}}\n')  # an earlier run's
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
    tracking = Tracking("p", "a", default_backend=[])
    with trace_state("phase"):
        pass
    tracking.log({"x": 1.0}, 1)
    tracking.finish()
    assert not (logs / "a.jsonl").exists(), "no metrics file made (the earlier run's moved aside, whole)"
    assert [e["name"] for e in _lines(logs / "a.events.jsonl")] == ["phase", "ml.step"]
    (aside,) = [p for p in logs.glob("a.*.jsonl") if p.name != "a.events.jsonl"]
    assert aside.read_text() == '{"step":1,"data":{"kept":1.0}}\n'
