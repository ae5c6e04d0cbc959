"""``otel-tracking timeline``: a picture of a step from the spans a run left, as a page headless
chromium shows with every lane (the step's root once, as the step's extent; every label inside the
picture), written beside its input, and as Chrome trace events that follow the format; and the
demo's straggler lane, named in its summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import viewers

LANES = ["driver", "driver / lane 0", "driver / lane 1", "driver / lane 2", "driver / lane 3"]
STEP_SPANS = ["ml.step", "step", "rollout", "generate", "generate", "generate", "generate", "reward", "update"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A demo run with four rollout lanes (the last one three times slower), file sink only."""
    root = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_", "TENSORBOARD_"))}
    done = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "demo", "--backends", "file", "--lanes", "4", "--steps", "6"],
        env={**env, "OTEL_TRACKING_SPOOL_DIR": str(root / "spool")},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return root, done.stdout


def _timeline(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_tracking", "timeline", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_demo_names_its_straggler_lane(demo: tuple[Path, str]) -> None:
    _, stdout = demo
    assert "The step's anatomy: goodput " in stdout, stdout
    assert "straggler: in 'rollout', driver / lane 3 ended last in 6 of 6 steps" in stdout, stdout
    assert "otel-tracking timeline " in stdout and "--steps 3" in stdout


def test_the_chrome_trace_follows_the_trace_event_format(demo: tuple[Path, str]) -> None:
    root, _ = demo
    done = _timeline(root, "otel-tracking-demo", "--steps", "3", "--out", "t3")
    assert done.returncode == 0, done.stderr
    assert "straggler: step 3 rollout: driver / lane 3, +0.0" in done.stdout
    trace = json.loads((root / "t3.json").read_text())
    events: list[dict[str, Any]] = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert sorted(e["name"] for e in complete) == sorted(STEP_SPANS)
    for event in complete:  # the fields of a complete event, in microseconds
        assert set(event) >= {"name", "ph", "ts", "dur", "pid", "tid"} and event["dur"] >= 0 and event["ts"] >= 0
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(threads.values()) == LANES, "one named track per lane"
    assert {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"} == {"driver"}
    by_lane: dict[str, list[dict[str, Any]]] = {}
    for event in complete:
        by_lane.setdefault(threads[event["tid"]], []).append(event)
    assert [e["name"] for e in by_lane["driver / lane 3"]] == ["generate"]
    # nested as in the trace: on one track, two events are nested or disjoint, never overlapping
    for lane_events in by_lane.values():
        for a in lane_events:
            for b in lane_events:
                a_end, b_end = a["ts"] + a["dur"], b["ts"] + b["dur"]
                assert (
                    a_end <= b["ts"]
                    or b_end <= a["ts"]
                    or (a["ts"] <= b["ts"] and b_end <= a_end)
                    or (b["ts"] <= a["ts"] and a_end <= b_end)
                ), (a, b)
    (rollout,) = [e for e in complete if e["name"] == "rollout"]
    for generate in (e for e in complete if e["name"] == "generate"):
        assert rollout["ts"] <= generate["ts"] and generate["ts"] + generate["dur"] <= rollout["ts"] + rollout["dur"]


def test_the_picture_shows_every_lane_in_a_browser(demo: tuple[Path, str]) -> None:
    root, _ = demo
    done = _timeline(root, "otel-tracking-demo", "--steps", "3", "--out", "picture")
    assert done.returncode == 0, done.stderr
    with viewers.browser() as browser:
        page = browser.page((root / "picture.html").as_uri())
        page.wait_for_text(["otel-tracking timeline: step 3", "driver / lane 3"])
        lanes = page.evaluate("[...document.querySelectorAll('text.lane')].map((t) => t.textContent)")
        spans = page.evaluate("[...document.querySelectorAll('rect.span')].map((r) => r.dataset.name)")
        drawn = page.evaluate(
            "[...document.querySelectorAll('rect.span')].every((r) => r.getBBox().width >= 1 && r.getBBox().height > 0)"
        )
        stragglers = page.evaluate("document.getElementById('stragglers').innerText")
        steps = page.evaluate("[...document.querySelectorAll('rect.step')].map((r) => r.textContent)")
        # every label ends inside the picture (the last tick's label was cut in half at the right edge)
        clipped = page.evaluate(
            "(() => { const svg = document.querySelector('svg'); const right = svg.width.baseVal.value;"
            " return [...svg.querySelectorAll('text')].filter((t) => { const b = t.getBBox();"
            " return b.x < 0 || b.x + b.width > right; }).map((t) => t.textContent); })()"
        )
        outlined = page.evaluate("[...document.querySelectorAll('rect.straggler')].map((r) => r.dataset.name)")
    assert lanes == LANES
    # the step's root is the step's extent on top, not a second bar beside the driver's `step` phase
    assert sorted(spans) == sorted(s for s in STEP_SPANS if s != "ml.step") and drawn
    assert steps == ["step 3: " + steps[0].split(": ", 1)[1]] and "the step's root span" in steps[0]
    assert clipped == []
    assert "straggler driver / lane 3" in stragglers
    assert outlined == ["generate"], "the straggler lane's span is outlined"


def test_steps_that_are_not_there_are_said(demo: tuple[Path, str]) -> None:
    root, _ = demo
    done = _timeline(root, "otel-tracking-demo", "--steps", "40-41")
    assert done.returncode == 2 and "no spans at steps 40-41 (steps found: 1-6)" in done.stdout
    bad = _timeline(root, "--steps", "3-1")
    assert bad.returncode == 2 and "is not a step or a range of steps" in bad.stderr


def _span_line(name: str, span_id: str, parent: str | None, start: int, end: int, **attributes: Any) -> str:
    return json.dumps(
        {
            "type": "span",
            "name": name,
            "trace_id": "ab" * 16,
            "span_id": span_id,
            "parent_span_id": parent,
            "start_time_unix_nano": start,
            "end_time_unix_nano": end,
            "attributes": attributes,
            "resource": {},
        },
        separators=(",", ":"),  # as the file sink writes it
    )


def test_a_bad_span_line_is_skipped_and_counted_not_the_end_of_the_read(tmp_path: Path) -> None:
    """A span without trace_id and one whose ml.step is NaN (both allowed by JSON as Python writes
    it) are left out and counted; the good ones are still drawn."""
    from io import StringIO

    from otel_tracking.cli.timeline import main

    good = [
        _span_line("ml.step", "01" * 8, None, 0, 100, **{"ml.step": 4}),
        _span_line("rollout", "02" * 8, "01" * 8, 10, 90, **{"ml.step": 4}),
    ]
    no_trace = json.loads(_span_line("update", "03" * 8, "01" * 8, 20, 30))
    del no_trace["trace_id"]
    nan_step = _span_line("update", "04" * 8, "01" * 8, 40, 50).replace(
        '"attributes":{}', '"attributes":{"ml.step":NaN}'
    )
    cut = _span_line("update", "05" * 8, "01" * 8, 60, 70)[:40]
    (tmp_path / "exp.events.jsonl").write_text(
        "\n".join([*good, json.dumps(no_trace, separators=(",", ":")), nan_step, cut]) + "\n"
    )
    out = StringIO()
    code = main([str(tmp_path)], "4", str(tmp_path / "t"), stdout=out)
    assert code == 0, out.getvalue()
    assert "skipped 3 span lines" in out.getvalue(), out.getvalue()
    assert "2 spans on 1 lanes, step 4" in out.getvalue()
    drawn = [e["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted(drawn) == ["ml.step", "rollout"]


def test_without_out_the_files_go_beside_the_events_file(demo: tuple[Path, str], tmp_path: Path) -> None:
    root, _ = demo
    events = next((root / "otel-tracking-demo").glob("grpo-simulated.events.jsonl"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _timeline(elsewhere, str(events), "--steps", "2")
    assert done.returncode == 0, done.stderr
    assert (events.parent / "timeline-step2.html").is_file() and (events.parent / "timeline-step2.json").is_file()
    assert list(elsewhere.iterdir()) == []
    assert f"{events.parent / 'timeline-step2.html'} (open in a browser)" in done.stdout
