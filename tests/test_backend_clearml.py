"""ClearML bridge: written offline through the facade and through a plain OTel SDK setup, read back
from the offline session's ``metrics.jsonl`` / ``task.json``, and compared with the reference."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PlainSdk
from tests.readers_clearml import ClearMLSession, wait_for_sessions

pytestmark = pytest.mark.backend

SECRET = "clearml-very-secret-5678"
CONFIG = {"trainer": {"total_epochs": 2, "lr": 0.1}, "data": {"max_prompt_length": 512}, "api_key": SECRET}
SAMPLES = [["what is 2+2?", "4", 1.0], ["capital of France?", "Lyon", 0.0]]


@pytest.fixture
def clearml_home(isolated: Path, monkeypatch: pytest.MonkeyPatch, clearml_config_file: Path) -> Path:
    home = isolated / "home-ours"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(clearml_config_file))
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    # Offline mode is process-wide ClearML state and stays on after the test (going back online
    # would try to reach a server).
    return home


def steps_payloads() -> list[tuple[dict[str, Any], int]]:
    """Keys with a '/', which the reference can report (it crashes on others); NaN/inf; bools; ints."""
    return [
        ({"train/loss": 0.5, "train/acc": 0, "optim/lr": 1e-3, "train/flag": True}, 0),
        ({"train/loss": float("nan"), "grad/norm": float("inf"), "grad/neg": float("-inf")}, 1),
        ({"train/loss": 0.25, "val-core/gsm8k/reward/mean@4": 0.75, "ünï/cødé": 3, "a key/b c": 2.5}, 2),
        ({"big/int": 2**40, "train/loss": 0.0625}, 10),
    ]


# What ClearML holds for those calls through our bridge: NaN/inf skipped (the reference wrote 0.0).
EXPECTED = [
    ("train", "loss", 0, 0.5),
    ("train", "acc", 0, 0.0),
    ("optim", "lr", 0, 1e-3),
    ("train", "flag", 0, 1.0),
    ("train", "loss", 2, 0.25),
    ("val-core", "gsm8k/reward/mean@4", 2, 0.75),
    ("ünï", "cødé", 2, 3.0),
    ("a key", "b c", 2, 2.5),
    ("big", "int", 10, float(2**40)),
    ("train", "loss", 10, 0.0625),
]
REFERENCE_NON_FINITE = [("train", "loss", 1, 0.0), ("grad", "norm", 1, 0.0), ("grad", "neg", 1, 0.0)]


def non_timing(session: ClearMLSession) -> list[tuple[str, str, int, float]]:
    return [s for s in session.user_scalars() if s[0] != "timing_s"]


def _files_containing(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_facade_writes_metrics_spans_generations_and_config(clearml_home: Path) -> None:
    from otel_tracking import DapoFilteredRewardTableLogger, Tracking, ValidationGenerationsLogger, trace_state

    tracking = Tracking("proj", "exp", default_backend=["clearml"], config=CONFIG)
    for data, step in steps_payloads():
        with trace_state("gen", step=step):
            pass
        tracking.log(data, step)
    # Fix: keys without '/' (the reference raised ValueError) and non-numbers (it raised AttributeError).
    tracking.log({"loss": 0.5, "note": "not a number", "train/after": 1.5}, 11)
    with trace_state("update_actor"):  # no step label: the step in progress (last logged + 1)
        pass
    ValidationGenerationsLogger().log(["clearml"], SAMPLES, 10)
    ValidationGenerationsLogger().log(["wandb"], [["not", "for", 0.0]], 10)  # not named: not written
    DapoFilteredRewardTableLogger().log(["clearml"], {0.0: 3, 1.0: 5}, 10)  # wandb-only in the reference
    tracking.finish()

    (session,) = wait_for_sessions(clearml_home)
    assert (session.project, session.name) == ("proj", "exp")
    assert non_timing(session) == [*EXPECTED, ("loss", "loss", 11, 0.5), ("train", "after", 11, 1.5)]

    timings = [(t, s, i) for t, s, i, _ in session.user_scalars() if t == "timing_s"]
    assert timings == [("timing_s", "state/gen", s) for _, s in steps_payloads()] + [
        ("timing_s", "state/update_actor", 12)
    ]
    assert all(0 <= v < 5 for t, _, _, v in session.user_scalars() if t == "timing_s")

    assert [(t, s, i) for t, s, i, _ in session.plots] == [("Validation", "Validation generations", 10)]
    ((iteration, header, rows),) = session.table("Validation", "Validation generations")
    assert (iteration, header) == (10, ["step", "input", "output", "score"])
    assert rows == [[10, "what is 2+2?", "4", 1.0], [10, "capital of France?", "Lyon", 0.0]]

    assert session.configuration["Hyperparameters"] == {
        "trainer": {"total_epochs": 2, "lr": 0.1},
        "data": {"max_prompt_length": 512},
        "api_key": "<redacted>",
    }
    assert _files_containing(clearml_home, SECRET) == []


def test_config_none_connects_no_configuration(clearml_home: Path, seed) -> None:
    # The reference cannot start with config=None: connect_configuration(None) raises.
    from clearml import Task

    from otel_tracking import Tracking

    Task.set_offline(True)
    with pytest.raises(ValueError, match="connect_configuration"):
        seed.ClearMLLogger("proj", "ref-none", None)
    Task.current_task().close()

    tracking = Tracking("proj", "none", default_backend="clearml", config=None)
    tracking.log({"x/y": 1.0}, 1)
    tracking.finish()
    sessions = wait_for_sessions(clearml_home, count=2)
    (ours,) = [s for s in sessions if s.name == "none"]
    assert "Hyperparameters" not in ours.has_configuration
    assert ours.user_scalars() == [("x", "y", 1, 1.0)]


def test_plain_otel_sdk_setup_shares_one_process_session(clearml_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_tracking.exporters import clearml as bridge

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "ml.project=sdkproj,ml.experiment=sdkexp")
    metric_exporter = bridge.ClearMLMetricExporter()
    span_exporter = bridge.ClearMLSpanExporter()
    assert metric_exporter.session is span_exporter.session
    app = PlainSdk(metric_exporter, span_exporter)
    for step in (1, 2, 3):
        app.span("rollout", **{"ml.step": step})
        app.log_step(step, {"train/loss": 1.0 / step})
    app.meters.shutdown()
    assert not metric_exporter.session.finished  # the span exporter still uses it
    app.tracers.shutdown()
    assert metric_exporter.session.finished

    (session,) = wait_for_sessions(clearml_home)
    assert str(session.path) in metric_exporter.session.where
    assert (session.project, session.name) == ("sdkproj", "sdkexp")
    assert non_timing(session) == [("train", "loss", 1, 1.0), ("train", "loss", 2, 0.5), ("train", "loss", 3, 1 / 3)]
    assert [(t, s, i) for t, s, i, _ in session.user_scalars() if t == "timing_s"] == [
        ("timing_s", "state/rollout", 1),
        ("timing_s", "state/rollout", 2),
        ("timing_s", "state/rollout", 3),
    ]


def test_same_calls_store_the_same_as_the_reference(
    seed, clearml_home: Path, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clearml import Task

    from otel_tracking import Tracking, ValidationGenerationsLogger

    reference_home = isolated / "home-reference"
    reference_home.mkdir()
    monkeypatch.setenv("HOME", str(reference_home))
    Task.set_offline(True)  # the reference relies on ClearML's own settings for offline mode
    reference = seed.Tracking("proj", "exp", default_backend="clearml", config=CONFIG)
    for data, step in steps_payloads():
        reference.log(data, step)
    seed.ValidationGenerationsLogger().log(["clearml"], SAMPLES, 10)
    with pytest.raises(ValueError):  # the reference's crash on a key without '/', fixed in ours
        reference.log({"loss": 0.5}, 11)
    reference.finish()

    monkeypatch.setenv("HOME", str(clearml_home))
    ours = Tracking("proj", "exp", default_backend="clearml", config=CONFIG)
    for data, step in steps_payloads():
        ours.log(data, step)
    ValidationGenerationsLogger().log(["clearml"], SAMPLES, 10)
    ours.finish()

    (theirs,) = wait_for_sessions(reference_home)
    (mine,) = wait_for_sessions(clearml_home)
    # Documented fix: NaN/inf are not sent (ClearML wrote them as 0.0 for the reference).
    assert [s for s in theirs.user_scalars() if s not in REFERENCE_NON_FINITE] == EXPECTED
    assert sorted(set(theirs.user_scalars()) - set(mine.user_scalars())) == sorted(REFERENCE_NON_FINITE)
    assert mine.user_scalars() == EXPECTED
    assert mine.table("Validation", "Validation generations") == theirs.table("Validation", "Validation generations")
    assert [p[:3] for p in mine.plots] == [p[:3] for p in theirs.plots]
    assert (mine.project, mine.name) == (theirs.project, theirs.name)
    # Same configuration, except that ours never holds the secret (the reference stored it in clear).
    assert theirs.configuration["Hyperparameters"]["api_key"] == SECRET
    assert mine.configuration == {
        "Hyperparameters": {**theirs.configuration["Hyperparameters"], "api_key": "<redacted>"}
    }
    assert not math.isnan(sum(v for *_, v in mine.user_scalars()))


def test_export_after_finish_fails_without_raising(clearml_home: Path) -> None:
    import os

    from opentelemetry.sdk.resources import Resource

    from otel_tracking.exporters import clearml as bridge
    from otel_tracking.exporters._base import TrackerContext
    from otel_tracking.signals.steps import step_batch

    parts = bridge.open_tracker(TrackerContext(project="p", experiment="e", env=os.environ))
    batch = step_batch(Resource({}), 1, {"x": 1.0, "y": float("nan")}, {"s": "text"}, 0)
    assert parts.metrics.export(batch).name == "SUCCESS"
    parts.finish(0)
    assert parts.metrics.export(step_batch(Resource({}), 2, {"x": 2.0}, {}, 0)).name == "FAILURE"
    (session,) = wait_for_sessions(clearml_home)
    assert session.user_scalars() == [("x", "x", 1, 1.0)]
