"""SwanLab bridge: written offline through the facade and through a plain OTel SDK setup, read back
with SwanLab's own ``DataStoreReader``, and compared with the reference (verl's tracking.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PlainSdk
from tests.readers_swanlab import SwanLabRun, wait_for_run

pytestmark = pytest.mark.backend

SECRET = "sk-swanlab-very-secret-1234"
CONFIG = {"trainer": {"total_epochs": 2, "lr": 0.1}, "data": {"max_prompt_length": 512}, "api_key": SECRET}
SAMPLES = [["what is 2+2?", "4", 1.0], ["capital of France?", "Lyon", 0.0]]


def _plain(value: float) -> Any:
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def triples(run: SwanLabRun, prefix_excluded: str = "timing_s/") -> list[tuple[str, int, Any]]:
    return [(k, s, _plain(v)) for k, s, v in run.scalars if not k.startswith(prefix_excluded)]


def steps_payloads() -> list[tuple[dict[str, Any], int]]:
    """What both implementations are fed: plain numbers, NaN/inf, bools, ints, odd keys, a string."""
    return [
        ({"train/loss": 0.5, "train/acc": 0, "lr": 1e-3, "flag": True}, 0),
        ({"train/loss": float("nan"), "grad/norm": float("inf"), "neg": float("-inf")}, 1),
        ({"train/loss": 0.25, "val-core/gsm8k/reward/mean@4": 0.75, "ünï/cødé": 3, "a key": 2.5}, 2),
        ({"train/loss": 0.125, "note": "a string is not a number"}, 3),
        ({"big": 2**40, "train/loss": 0.0625}, 10),
    ]


EXPECTED = [
    ("train/loss", 0, 0.5),
    ("train/acc", 0, 0.0),
    ("lr", 0, 1e-3),
    ("flag", 0, 1.0),
    ("train/loss", 1, "nan"),
    ("grad/norm", 1, math.inf),
    ("neg", 1, -math.inf),
    ("train/loss", 2, 0.25),
    ("val-core/gsm8k/reward/mean@4", 2, 0.75),
    ("ünï/cødé", 2, 3.0),
    ("a key", 2, 2.5),
    ("train/loss", 3, 0.125),
    ("big", 10, float(2**40)),
    ("train/loss", 10, 0.0625),
]


@pytest.fixture
def swanlab_env(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log_dir = isolated / "swanlog-ours"
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(log_dir))
    monkeypatch.setenv("HOME", str(isolated / "home"))
    return log_dir


def _files_containing(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_facade_writes_metrics_spans_generations_and_config(swanlab_env: Path) -> None:
    from otel_tracking import DapoFilteredRewardTableLogger, Tracking, ValidationGenerationsLogger, trace_state

    tracking = Tracking("proj", "exp", default_backend=["swanlab"], config=CONFIG)
    for data, step in steps_payloads():
        with trace_state("gen", step=step):
            pass
        tracking.log(data, step)
    with trace_state("update_actor"):  # no step label: the step in progress (last logged + 1)
        pass
    ValidationGenerationsLogger().log(["swanlab"], SAMPLES, 10)
    ValidationGenerationsLogger().log(["wandb"], [["not", "for", 0.0]], 10)  # not named: not written
    DapoFilteredRewardTableLogger().log(["swanlab"], {0.0: 3, 1.0: 5}, 10)  # wandb-only in the reference
    tracking.finish()

    (run,) = wait_for_run(swanlab_env)
    assert (run.project, run.name) == ("proj", "exp")
    assert run.finish_state == "RUN_STATE_FINISHED"
    assert triples(run) == EXPECTED

    timings = [(k, s) for k, s, _ in run.scalars if k.startswith("timing_s/")]
    assert timings == [("timing_s/state/gen", s) for _, s in steps_payloads()] + [("timing_s/state/update_actor", 11)]
    assert all(0 <= v < 5 for k, _, v in run.scalars if k.startswith("timing_s/"))

    assert [key for key, _, _ in run.media] == ["val/generations"]
    ((step, table),) = run.tables("val/generations")
    assert step == 10
    assert [c["field"] for c in table["colDefs"]] == ["step", "input", "output", "score"]
    assert table["rowData"] == [
        {"step": 10, "input": "what is 2+2?", "output": "4", "score": 1.0},
        {"step": 10, "input": "capital of France?", "output": "Lyon", "score": 0.0},
    ]
    assert "training/filter_groups/filtered_reward_counts" not in {k for k, _, _ in run.scalars}

    assert run.config["FRAMEWORK"] == "verl"
    assert run.config["trainer"] == {"total_epochs": 2, "lr": 0.1}
    assert run.config["data"] == {"max_prompt_length": 512}
    assert run.config["api_key"] == "<redacted>"
    assert _files_containing(swanlab_env, SECRET) == []


def test_config_none_and_crashed_exit_code(swanlab_env: Path) -> None:
    from otel_tracking import Tracking

    tracking = Tracking("proj", "crash", default_backend="swanlab", config=None)
    tracking.log({"x": 1.0}, 1)
    tracking.finish(exit_code=3)
    (run,) = wait_for_run(swanlab_env)
    assert run.finish_state == "RUN_STATE_CRASHED"
    assert run.config == {"FRAMEWORK": "verl"}
    assert triples(run) == [("x", 1, 1.0)]


def test_api_key_is_not_used_offline_and_never_stored(swanlab_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import swanlab

    from otel_tracking import Tracking

    logins: list[Any] = []
    monkeypatch.setattr(swanlab, "login", lambda *a, **k: logins.append((a, k)))
    # The bridge in this process, so that the patched login above is the one it would call (in the
    # bridge process the patch would not be seen, and the assertion below could not fail).
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", "false")
    monkeypatch.setenv("SWANLAB_API_KEY", SECRET)
    tracking = Tracking("proj", "keyed", default_backend=["swanlab"], config={"trainer": {"x": 1}})
    tracking.log({"x": 1.0}, 1)
    tracking.finish()
    (run,) = wait_for_run(swanlab_env)
    assert logins == []  # offline: no login (the reference tried one, and without a network it raises)
    assert triples(run) == [("x", 1, 1.0)]
    assert _files_containing(swanlab_env, SECRET) == []
    assert SECRET not in repr(run.config)


def test_api_key_goes_to_login_only_when_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online needs the network: check the calls themselves (login(key), then init without the key)."""
    import swanlab

    from otel_tracking.exporters import swanlab as bridge
    from otel_tracking.exporters._base import TrackerContext

    calls: list[tuple[str, Any]] = []

    class FakeRun:
        dir = "/nowhere"

    monkeypatch.setattr(swanlab, "login", lambda *a, **k: calls.append(("login", (a, k))))
    monkeypatch.setattr(swanlab, "init", lambda **k: calls.append(("init", k)) or FakeRun())
    context = TrackerContext(project="p", experiment="e", config={"a": 1}, env={"SWANLAB_API_KEY": SECRET})
    bridge.open_tracker(context)
    assert calls[0] == ("login", ((SECRET,), {}))
    name, kwargs = calls[1]
    assert name == "init"
    assert kwargs == {
        "project": "p",
        "name": "e",
        "config": {"FRAMEWORK": "verl", "a": 1},
        "log_dir": "swanlog",
        "mode": "cloud",
    }
    assert SECRET not in repr(kwargs)


def test_plain_otel_sdk_setup_shares_one_process_session(swanlab_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_tracking.exporters import swanlab as bridge

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "ml.project=sdkproj,ml.experiment=sdkexp")
    metric_exporter = bridge.SwanLabMetricExporter()
    span_exporter = bridge.SwanLabSpanExporter()
    assert metric_exporter.session is span_exporter.session
    app = PlainSdk(metric_exporter, span_exporter)
    for step in (1, 2, 3):
        app.span("rollout", **{"ml.step": step})
        app.log_step(step, {"train/loss": 1.0 / step})
    app.meters.shutdown()
    assert not metric_exporter.session.finished  # the span exporter still uses it
    app.tracers.shutdown()
    assert metric_exporter.session.finished

    (run,) = wait_for_run(swanlab_env)
    assert str(run.path) in metric_exporter.session.where
    assert (run.project, run.name) == ("sdkproj", "sdkexp")
    assert triples(run) == [("train/loss", 1, 1.0), ("train/loss", 2, 0.5), ("train/loss", 3, 1 / 3)]
    assert [(k, s) for k, s, _ in run.scalars if k.startswith("timing_s/")] == [
        ("timing_s/state/rollout", 1),
        ("timing_s/state/rollout", 2),
        ("timing_s/state/rollout", 3),
    ]


def test_same_calls_store_the_same_as_the_reference(
    seed, swanlab_env: Path, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otel_tracking import Tracking, ValidationGenerationsLogger

    reference_dir = isolated / "swanlog-reference"
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(reference_dir))
    reference = seed.Tracking("proj", "exp", default_backend="swanlab", config=CONFIG)
    for data, step in steps_payloads():
        reference.log(data, step)
    seed.ValidationGenerationsLogger().log(["swanlab"], SAMPLES, 10)
    reference.finish()

    monkeypatch.setenv("SWANLAB_LOG_DIR", str(swanlab_env))
    ours = Tracking("proj", "exp", default_backend="swanlab", config=CONFIG)
    for data, step in steps_payloads():
        ours.log(data, step)
    ValidationGenerationsLogger().log(["swanlab"], SAMPLES, 10)
    ours.finish()

    (theirs,) = wait_for_run(reference_dir)
    (mine,) = wait_for_run(swanlab_env)
    assert triples(mine) == triples(theirs) == EXPECTED
    assert [(k, s) for k, s, _ in mine.media] == [(k, s) for k, s, _ in theirs.media] == [("val/generations", 10)]
    assert mine.tables("val/generations") == theirs.tables("val/generations")
    assert (mine.project, mine.name, mine.finish_state) == (theirs.project, theirs.name, theirs.finish_state)
    # Same config, except that ours never holds the secret (the reference stored it in clear).
    assert theirs.config["api_key"] == SECRET
    assert mine.config == {**theirs.config, "api_key": "<redacted>"}


def test_export_after_finish_fails_without_raising(swanlab_env: Path) -> None:
    import os

    from opentelemetry.sdk.resources import Resource

    from otel_tracking.exporters import swanlab as bridge
    from otel_tracking.exporters._base import TrackerContext
    from otel_tracking.signals.steps import step_batch

    parts = bridge.open_tracker(TrackerContext(project="p", experiment="e", env=os.environ))
    batch = step_batch(Resource({}), 1, {"x": 1.0}, {"s": "text"}, 0)
    assert parts.metrics.export(batch).name == "SUCCESS"
    parts.finish(0)
    assert parts.metrics.export(step_batch(Resource({}), 2, {"x": 2.0}, {}, 0)).name == "FAILURE"
    (run,) = wait_for_run(swanlab_env)
    assert triples(run) == [("x", 1, 1.0)]
