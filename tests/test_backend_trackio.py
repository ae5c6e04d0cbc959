"""Trackio bridge: a local Trackio project written through the facade and through a plain OTel SDK
setup, read back with Trackio's own ``SQLiteStorage``, and compared with the reference (verl's
tracking.py) fed the same calls.

Trackio reads ``TRACKIO_DIR`` once, at import: every test of this file shares one directory for
the session and writes to its own project.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import STEP_VALUES, PlainSdk

pytestmark = pytest.mark.backend

SECRET = "sk-trackio-very-secret-1234"
CONFIG = {"trainer": {"total_epochs": 2, "lr": 0.1}, "data": {"max_prompt_length": 512}, "api_key": SECRET}
SAMPLES = [["what is 2+2?", "4", 1.0], ["capital of France?", "Lyon", 0], ["only one part"]]


def steps_payloads() -> list[tuple[dict[str, Any], int]]:
    """Numbers, NaN/inf, bools, odd keys, Trackio's reserved key ``step``, non-number values, a
    key logged at one step only, a step going backwards, and an empty call."""
    return [
        ({"train/loss": 0.1, "train/acc": 0, "lr": 1e-3, "flag": True}, 0),
        ({"train/loss": float("nan"), "grad/norm": float("inf"), "neg": float("-inf")}, 1),
        ({"train/loss": 0.25, "val-core/gsm8k/reward/mean@4": 0.75, "ünï/cødé": 3, "a key": 2.5, "step": 2}, 2),
        ({"train/loss": 0.125, "note": "a string", "nothing": None, "items": [1, 2], "nested": {"k": 1.5}}, 3),
        ({"big": 2**40, "train/loss": 0.0625}, 10),
        ({"train/loss": 0.5}, 5),
        ({}, 7),  # an empty call still makes a (metric-less) row
    ]


EXPECTED_ROWS = [
    (0, {"train/loss": 0.1, "train/acc": 0, "lr": 1e-3, "flag": True}),
    (1, {"train/loss": "nan", "grad/norm": math.inf, "neg": -math.inf}),
    (2, {"train/loss": 0.25, "val-core/gsm8k/reward/mean@4": 0.75, "ünï/cødé": 3, "a key": 2.5, "__step": 2}),
    (3, {"train/loss": 0.125, "note": "a string", "nothing": None, "items": [1, 2], "nested": {"k": 1.5}}),
    (10, {"big": 2**40, "train/loss": 0.0625}),
    (5, {"train/loss": 0.5}),
]


def expected_traces(step: int) -> list[tuple[int, int, list[dict[str, str]], dict[str, Any]]]:
    """(step, index, messages, metadata) as the reference's log_generations_to_trackio makes them."""
    return [
        (
            step,
            0,
            [{"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": "4"}],
            {"source": "validation_generations", "sample_index": 0, "score": 1.0},
        ),
        (
            step,
            1,
            [{"role": "user", "content": "capital of France?"}, {"role": "assistant", "content": "Lyon"}],
            {"source": "validation_generations", "sample_index": 1, "score": 0},
        ),
        (
            step,
            2,
            [{"role": "user", "content": "['only one part']"}, {"role": "assistant", "content": ""}],
            {"source": "validation_generations", "sample_index": 2, "score": None},
        ),
    ]


# --- reading back ------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    return "nan" if isinstance(value, float) and math.isnan(value) else value


TABLE_KEY = "val/generations_table"  # ours only (the reference logs traces alone): read by generations_tables()


def rows(project: str, run: str) -> list[tuple[int, dict[str, Any]]]:
    """Each trackio.log() row of a run as (step, metrics), timestamps and the generations table
    dropped, NaN as "nan"."""
    from trackio.sqlite_storage import SQLiteStorage

    result = []
    for row in SQLiteStorage.get_logs(project, run):
        metrics = {k: _plain(v) for k, v in row.items() if k not in ("timestamp", "step", TABLE_KEY)}
        result.append((row["step"], metrics))
    return result


def generations_tables(project: str, run: str) -> list[tuple[int, str, list[dict[str, Any]]]]:
    """(step, type, rows) of each generations table, as Trackio's Media page reads them."""
    from trackio.sqlite_storage import SQLiteStorage

    return [
        (row["step"], row[TABLE_KEY]["_type"], row[TABLE_KEY]["_value"])
        for row in SQLiteStorage.get_logs(project, run)
        if TABLE_KEY in row
    ]


def expected_table(step: int) -> list[tuple[int, str, list[dict[str, Any]]]]:
    return [
        (
            step,
            "trackio.table",
            [
                {"step": step, "sample": 0, "input": "what is 2+2?", "output": "4", "score": 1.0},
                {"step": step, "sample": 1, "input": "capital of France?", "output": "Lyon", "score": 0},
                {"step": step, "sample": 2, "input": "['only one part']", "output": "", "score": None},
            ],
        )
    ]


def traces(project: str, run: str) -> list[tuple[int, int, list[dict[str, Any]], dict[str, Any]]]:
    from trackio.sqlite_storage import SQLiteStorage

    found = [
        (t["step"], t["index"], t["messages"], t["metadata"])
        for t in SQLiteStorage.get_traces(project, run)
        if t["key"] == "val/generations"
    ]
    return sorted(found, key=lambda t: (t[0], t[1]))


def config_of(project: str, run: str) -> dict[str, Any]:
    from trackio.sqlite_storage import SQLiteStorage

    config = SQLiteStorage.get_run_config(project, run) or {}
    return {k: v for k, v in config.items() if not k.startswith("_")}


def metric_values(project: str, run: str, key: str) -> list[tuple[int, Any]]:
    from trackio.sqlite_storage import SQLiteStorage

    return [(v["step"], _plain(v["value"])) for v in SQLiteStorage.get_metric_values(project, run, key)]


def split_timings(
    found: list[tuple[int, dict[str, Any]]],
) -> tuple[list[tuple[int, dict[str, Any]]], list[tuple[int, str, float]]]:
    plain, timings = [], []
    for step, metrics in found:
        timing = {k: v for k, v in metrics.items() if k.startswith("timing_s/")}
        rest = {k: v for k, v in metrics.items() if not k.startswith("timing_s/")}
        timings.extend((step, k, v) for k, v in timing.items())
        if rest:
            plain.append((step, rest))
    return plain, timings


# --- the environment ---------------------------------------------------------------------------


@pytest.fixture
def trackio_env(isolated: Path, trackio_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """TRACKIO_DIR set before Trackio's first import; yields a project name of this test's own."""
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    monkeypatch.setenv("HOME", str(isolated / "home"))
    monkeypatch.setenv("HF_HOME", str(isolated / "home" / "hf"))
    if "trackio" in sys.modules:
        from trackio import utils

        assert Path(utils.TRACKIO_DIR) == trackio_dir, f"trackio was imported earlier with {utils.TRACKIO_DIR}"
    yield f"proj-{isolated.name}"
    if "trackio" in sys.modules:
        from trackio import context_vars

        assert context_vars.current_run.get() is None, "a test left a Trackio run open"


# --- through the facade ------------------------------------------------------------------------


def test_facade_writes_metrics_spans_generations_and_config(trackio_env: str) -> None:
    from otel_tracking import DapoFilteredRewardTableLogger, Tracking, ValidationGenerationsLogger, trace_state

    project = trackio_env
    tracking = Tracking(project, "exp", default_backend=["trackio"], config=CONFIG)
    assert project in tracking.where()["trackio"]
    for data, step in steps_payloads():
        with trace_state("gen", step=step):
            pass
        tracking.log(data, step)
    with trace_state("update_actor"):  # no step label: the step in progress (last logged + 1)
        pass
    ValidationGenerationsLogger().log(["trackio"], SAMPLES, 10)
    ValidationGenerationsLogger().log(["wandb"], [["not", "for", 0.0]], 11)  # not named: not written
    DapoFilteredRewardTableLogger().log(["trackio"], {0.0: 3, 1.0: 5}, 10)  # wandb-only in the reference
    stats = tracking.finish()
    assert stats["trackio"]["failed"] == 0

    # finish() returned: everything is in the sqlite file, no polling needed.
    found, timings = split_timings(rows(project, "exp"))
    assert [r for r in found if r[1]] == EXPECTED_ROWS
    assert [(step, key) for step, key, _ in timings] == [
        (0, "timing_s/state/gen"),
        (1, "timing_s/state/gen"),
        (2, "timing_s/state/gen"),
        (3, "timing_s/state/gen"),
        (10, "timing_s/state/gen"),
        (5, "timing_s/state/gen"),
        (7, "timing_s/state/gen"),
        (8, "timing_s/state/update_actor"),
    ]
    assert all(0.0 <= seconds < 5.0 for _, _, seconds in timings)
    assert metric_values(project, "exp", "train/loss") == [
        (0, 0.1),
        (1, "nan"),
        (2, 0.25),
        (3, 0.125),
        (10, 0.0625),
        (5, 0.5),
    ]
    assert metric_values(project, "exp", "grad/norm") == [(1, math.inf)]
    assert traces(project, "exp") == expected_traces(10)
    assert generations_tables(project, "exp") == expected_table(10)  # the score as a column
    assert config_of(project, "exp") == {**CONFIG, "api_key": "<redacted>"}


def _log_in_a_thread(tracking: Any, data: dict[str, Any], step: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            tracking.log(data, step)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return errors


@pytest.mark.parametrize("bridge_process", ["false", "true"])  # the bridge in this process, where it matters
def test_log_from_another_thread_reaches_the_run(
    trackio_env: str, seed: types.ModuleType, bridge_process: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fix: trackio.log finds its run through a context variable that other threads do not see, so
    the reference's log() raised there; the bridge logs to its Run object directly."""
    from otel_tracking import Tracking

    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", bridge_process)

    reference = seed.Tracking(f"{trackio_env}-ref", "exp", default_backend="trackio")
    errors = _log_in_a_thread(reference, {"loss": 1.0}, 1)
    reference.finish()
    assert [type(e) for e in errors] == [RuntimeError]

    experiment = f"exp-{bridge_process}"
    tracking = Tracking(trackio_env, experiment, default_backend="trackio")
    assert _log_in_a_thread(tracking, {"loss": 1.0}, 1) == []
    tracking.log({"loss": 0.5}, 2)
    tracking.finish()
    assert rows(trackio_env, experiment) == [(1, {"loss": 1.0}), (2, {"loss": 0.5})]


def test_an_existing_trackio_run_is_reused_and_finished(trackio_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import trackio
    from trackio import context_vars

    from otel_tracking import Tracking

    # A run opened by the training process can only be reused by a bridge in that process.
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", "false")
    trackio.init(project=trackio_env, name="mine", embed=False)
    tracking = Tracking(trackio_env, "exp", default_backend="trackio")
    tracking.log({"x": 1}, 0)
    tracking.finish()
    assert context_vars.current_run.get() is None
    assert rows(trackio_env, "mine") == [(0, {"x": 1})]
    assert rows(trackio_env, "exp") == []


def test_exporters_return_failure_after_finish(trackio_env: str) -> None:
    from opentelemetry.sdk.metrics.export import MetricExportResult
    from opentelemetry.sdk.resources import Resource

    from otel_tracking.exporters._base import TrackerContext
    from otel_tracking.exporters.trackio import open_tracker
    from otel_tracking.signals.steps import step_batch

    parts = open_tracker(TrackerContext(project=trackio_env, experiment="e", env=os.environ))
    batch = step_batch(Resource.create({}), 1, {"x": 1.0}, {}, 1)
    assert parts.metrics.export(batch) is MetricExportResult.SUCCESS
    parts.finish(0)
    parts.finish(0)  # idempotent
    assert parts.metrics.export(batch) is MetricExportResult.FAILURE
    assert rows(trackio_env, "e") == [(1, {"x": 1.0})]


# --- through a plain OpenTelemetry SDK setup ---------------------------------------------------


def test_plain_otel_sdk_exporters_share_one_run(trackio_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_tracking.exporters.trackio import TrackioLogExporter, TrackioMetricExporter, TrackioSpanExporter

    project = trackio_env
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"ml.project={project},ml.experiment=sdkexp")
    metric_exporter = TrackioMetricExporter()
    span_exporter = TrackioSpanExporter()
    log_exporter = TrackioLogExporter()
    assert metric_exporter.session is span_exporter.session is log_exporter.session

    app = PlainSdk(metric_exporter, span_exporter, log_exporter)
    for step, value in ((3, 0.5), (4, 0.25)):
        app.log_step(step, {"loss": value})
    app.span("rollout", **{"ml.step": 4})
    app.emit(
        "ml.validation.generations",
        {"samples": SAMPLES},
        {"ml.step": 10, "ml.key": "val/generations", "ml.backends": ["trackio"]},
    )
    app.shutdown()
    assert metric_exporter.session.closed

    found, timings = split_timings(rows(project, "sdkexp"))
    assert [r for r in found if r[1]] == [(3, {"loss": 0.5}), (4, {"loss": 0.25})]
    assert [(step, key) for step, key, _ in timings] == [(4, "timing_s/state/rollout")]
    assert traces(project, "sdkexp") == expected_traces(10)


# --- against the reference ---------------------------------------------------------------------


def test_differential_against_the_reference(trackio_env: str, seed: types.ModuleType) -> None:
    from otel_tracking import Tracking, ValidationGenerationsLogger

    reference_project, our_project = f"{trackio_env}-ref", f"{trackio_env}-ours"
    reference = seed.Tracking(reference_project, "exp", default_backend="trackio", config=CONFIG)
    for data, step in steps_payloads():
        reference.log(data, step)
    seed.ValidationGenerationsLogger(reference_project, "exp").log(["trackio"], SAMPLES, 10)
    reference.finish()

    ours = Tracking(our_project, "exp", default_backend="trackio", config=CONFIG)
    for data, step in steps_payloads():
        ours.log(data, step)
    ValidationGenerationsLogger(our_project, "exp").log(["trackio"], SAMPLES, 10)
    ours.finish()

    reference_rows = rows(reference_project, "exp")
    assert [r for r in reference_rows if r[1]] == EXPECTED_ROWS  # the reference stores the same
    assert rows(our_project, "exp") == reference_rows  # same rows, steps, values, generations row included
    for key in ("train/loss", "grad/norm", "big", "note", "__step"):
        assert metric_values(our_project, "exp", key) == metric_values(reference_project, "exp", key)
    assert traces(our_project, "exp") == traces(reference_project, "exp") == expected_traces(10)
    # Documented differences: the generations also as a table (score a column), in the same row;
    assert generations_tables(reference_project, "exp") == []
    assert generations_tables(our_project, "exp") == expected_table(10)
    # secrets in the config are redacted before they reach Trackio.
    assert config_of(reference_project, "exp") == CONFIG
    assert config_of(our_project, "exp") == {**CONFIG, "api_key": "<redacted>"}


def test_rows_carry_the_time_of_their_log_call(trackio_env: str) -> None:
    """A backlog (Trackio opened late, a slow bridge) reaches Trackio in one burst; each row must
    still carry the time its ``log()`` ran, not the time Trackio's sender wrote the batch."""
    from datetime import datetime

    from trackio.sqlite_storage import SQLiteStorage

    from otel_tracking.exporters._base import StepRecord, TrackerContext
    from otel_tracking.exporters.trackio import TrackioSession

    session = TrackioSession(TrackerContext(project=trackio_env, experiment="late", env=os.environ))
    hour_ago_ns = time.time_ns() - 3600 * 10**9
    logged = {step: hour_ago_ns + step * 60 * 10**9 for step in range(1, 6)}  # a minute apart, an hour ago
    for step, at in logged.items():
        session.write_step(StepRecord(step=step, scalars={"loss": 1.0 / step}, time_unix_nano=at))
    session.finish()

    rows_found = SQLiteStorage.get_logs(trackio_env, "late")
    found = {row["step"]: datetime.fromisoformat(row["timestamp"]) for row in rows_found}
    assert found.keys() == logged.keys()
    for step, at in logged.items():
        assert abs(found[step].timestamp() - at / 1e9) < 1e-3, (step, found[step])


# --- the rows queued without run.log ---------------------------------------------------------------

_KEYS = st.one_of(
    st.sampled_from(["loss", "a/b", "step", "time", "__private", "ünï", "bad\ud800"]), st.text(max_size=6)
)
_STEPS = st.lists(st.tuples(st.dictionaries(_KEYS, STEP_VALUES, max_size=6), st.integers(0, 40)), max_size=8)
_RUNS = iter(range(10**6))


def _raw_rows(project: str, run: str) -> list[tuple[int, list[tuple[str, Any]]]]:
    """Every row as Trackio's reader returns it, but for the time; NaN as a marker a string
    "nan" is not."""
    from trackio.sqlite_storage import SQLiteStorage

    return [
        (row["step"], [(k, ("<NaN>",) if v != v else v) for k, v in row.items() if k not in ("timestamp", "step")])
        for row in SQLiteStorage.get_logs(project, run)
    ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_STEPS)
@example(steps=[({"loss": math.nan, "up": math.inf, "down": -math.inf, "n": 3, "ok": True}, 0), ({"big": 2**64}, 1)])
def test_rows_queued_directly_are_the_rows_run_log_writes(trackio_env: str, steps: list[tuple[dict, int]]) -> None:
    """The bridge queues a step of plain numbers itself (run.log costs more than the rest of the
    bridge); every row, value and config must be what run.log writes for the same calls."""
    import trackio

    from otel_tracking.exporters._base import TrackerContext
    from otel_tracking.exporters.trackio import TrackioSession

    name = next(_RUNS)
    own = trackio.init(project=trackio_env, name=f"log-{name}", config={"lr": 0.1}, embed=False)
    for data, step in steps:
        own.log(dict(data), step=step)
    trackio.finish()

    context = TrackerContext(project=trackio_env, experiment=f"ours-{name}", env=os.environ, config={"lr": 0.1})
    session = TrackioSession(context)
    assert session._queue_rows  # this Trackio has the internals: the direct path is what runs
    for data, step in steps:
        session.log(dict(data), step)
    session.finish()

    assert _raw_rows(trackio_env, f"ours-{name}") == _raw_rows(trackio_env, f"log-{name}")
    config = {"lr": 0.1} if steps else {}  # Trackio writes a run's config with its first row
    assert config_of(trackio_env, f"ours-{name}") == config_of(trackio_env, f"log-{name}") == config


# --- the contract with the pinned Trackio (compat/trackio_internals.py) -----------------------------


def test_the_pinned_trackio_has_every_private_name_and_is_a_tested_release(trackio_env: str) -> None:
    import importlib

    import trackio

    from otel_tracking.compat import trackio_internals

    assert trackio_internals.tested_version(trackio), (
        f"Trackio {trackio.__version__} is not in TESTED_RELEASES {trackio_internals.TESTED_RELEASES}: "
        "run these tests against it, then add it"
    )
    run = trackio.init(project=trackio_env, name="contract", embed=False)
    try:
        for where, names in trackio_internals.PRIVATE_NAMES.items():
            if where == "trackio run":
                holder: Any = run
            else:
                module, _, attribute = where.rpartition(".")
                holder = (
                    importlib.import_module(where)
                    if where == "trackio.utils"
                    else getattr(importlib.import_module(module), attribute)
                )
            lacking = [name for name in names if not hasattr(holder, name)]
            assert not lacking, f"{where} lacks {lacking}: the rows and their times go through run.log"
        assert run._is_local
    finally:
        trackio.finish()


def test_without_a_private_name_run_log_writes_every_row_with_one_warning(
    trackio_env: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from otel_tracking.compat import trackio_internals
    from otel_tracking.exporters._base import TrackerContext
    from otel_tracking.exporters.trackio import TrackioSession

    monkeypatch.setattr(trackio_internals._say, "said", set())
    # A release without one of the names (taking a real one away from Trackio breaks Trackio itself)
    monkeypatch.setattr(trackio_internals, "ROWS", (*trackio_internals.ROWS, "_renamed_by_a_release"))
    session = TrackioSession(TrackerContext(project=trackio_env, experiment="moved", env=os.environ))
    assert (session._row_times, session._queue_rows) == (False, False)
    for step in range(3):
        session.log({"loss": 1.0 / (step + 1)}, step)
    session.finish()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "_renamed_by_a_release" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert _raw_rows(trackio_env, "moved") == [(s, [("loss", 1.0 / (s + 1))]) for s in range(3)]
