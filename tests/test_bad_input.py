"""Bad input gets its error before anything is recorded, and names that become paths stay in
their directory (issue 19, items 2, 11, 14, 15)."""

from __future__ import annotations

import json
import logging
import os
import re
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_tracking import ConfigError, Tracking
from otel_tracking.config.paths import spool_dir, spool_root
from otel_tracking.config.resume import RunRecord, record_name
from otel_tracking.config.settings import build_settings
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.spool import sink_spool
from otel_tracking.distributed.environment import build_worker_settings


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1.0}
    for _ in range(depth):
        value = {"d": value}
    return value


def _cycle() -> list:
    items: list = [1.0]
    items.append(items)
    return items


@pytest.mark.parametrize(
    ("data", "step", "message"),
    [
        ({"x": 1.0, "deep": _nested(252)}, 1, "value of 'deep' cannot be written: it is nested more than 252"),
        ({"x": 1.0, "deep": _nested(300)}, 1, "value of 'deep' cannot be written: it is nested more than 252 levels"),
        ({"x": 1.0, "loop": _cycle()}, 1, "value of 'loop' cannot be written"),
        ({"x": 1.0, "text": "bad \ud800 surrogate"}, 1, "value of 'text' cannot be written"),
        ({"x": 1.0, "bad \udcff key": 2.0}, 1, "is not valid Unicode"),
        ({"x": 1.0}, 2**70, "step must fit in a signed 64-bit integer"),
    ],
)
def test_a_value_no_sink_can_write_raises_before_anything_is_recorded(
    isolated: Path, capsys: pytest.CaptureFixture[str], data: dict, step: int, message: str
) -> None:
    """The reference raised TypeError for the deep dict and the huge step (its orjson dump); we
    lost the whole step in the file and console sinks with only a warning, and counted it failed."""
    os.environ["VERL_FILE_LOGGER_ROOT"] = str(isolated / "logs")
    tracking = Tracking("p", "e", default_backend=["file", "console"])
    try:
        with pytest.raises(TypeError, match=message):
            tracking.log(data, step)
        tracking.log({"x": 2.0}, 3)
    finally:
        stats = tracking.finish()
        del os.environ["VERL_FILE_LOGGER_ROOT"]
    lines = (isolated / "logs" / "p" / "e.jsonl").read_text().splitlines()
    assert lines == ['{"step":3,"data":{"x":2.0}}']
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")] == ["step:3 - x:2.0"]
    assert stats["file"] == {"delivered": 1, "failed": 0, "retried": 0, "spooled": 0, "dropped": 0}


def test_values_at_the_limits_are_written_by_the_documented_rules(isolated: Path) -> None:
    """252 levels of nesting in a value is what orjson writes in the file line; ints beyond 64 bits
    inside a value become floats; an int beyond 64 bits as a number is a float everywhere (the reference raised)."""
    os.environ["VERL_FILE_LOGGER_ROOT"] = str(isolated / "logs")
    tracking = Tracking("p", "e", default_backend=["file"])
    try:
        tracking.log({"x": 1.0, "deep": _nested(251), "big": [2**70], "huge": 2**70, "u": 2**64 - 1}, 1)
    finally:
        tracking.finish()
        del os.environ["VERL_FILE_LOGGER_ROOT"]
    (line,) = (isolated / "logs" / "p" / "e.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["data"]["big"] == [float(2**70)] and record["data"]["huge"] == float(2**70)
    assert record["data"]["u"] == 2**64 - 1 and '"u":18446744073709551615' in line  # exact, as orjson writes it


def test_a_failed_tracking_leaves_nothing_open_and_nothing_written(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``OTEL_METRICS_EXPORTER=file,bogus``: the file sink was created (its line printed, its file
    made) before the bad name failed; and a tracker named before it stayed open."""
    from otel_tracking.runtime import run as run_module

    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(isolated / "logs"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(isolated / "tb"))
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", "false")
    for variable, value in (
        ("OTEL_METRICS_EXPORTER", "file,tensorboard,bogus"),
        ("OTEL_TRACES_EXPORTER", "tensorboard,bogus"),
    ):
        monkeypatch.setenv(variable, value)
        with pytest.raises(ConfigError, match="'bogus'"):
            Tracking("p", "e", default_backend=["console", "file"])
        monkeypatch.delenv(variable)
        assert run_module.current_run() is None
        assert not (isolated / "logs").exists(), "no file made"
        assert not (isolated / "tb").exists(), "no tracker opened"
        assert "Creating file logger" not in capsys.readouterr().out
    # A tracker that fails while it opens (here: its directory cannot be made) fails before the
    # file sink, which is built last, creates anything.
    blocker = isolated / "blocker"
    blocker.write_text("")
    monkeypatch.setenv("TENSORBOARD_DIR", str(blocker / "tb"))
    with pytest.raises(ConfigError, match="'tensorboard' cannot write"):
        Tracking("p", "e", default_backend=["file", "tensorboard"])
    assert run_module.current_run() is None and not (isolated / "logs").exists()
    assert "Creating file logger" not in capsys.readouterr().out
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "file,tensorboard")  # the same rule for OTEL_*_EXPORTER sinks
    with pytest.raises(ConfigError, match="'tensorboard' cannot write"):
        Tracking("p", "e", default_backend=["console"])
    assert run_module.current_run() is None and not (isolated / "logs").exists()
    assert "Creating file logger" not in capsys.readouterr().out


def test_a_config_error_leaves_no_spool_and_no_record(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(isolated / "logs"))
    with pytest.raises(ConfigError, match="RANK='zero'"):
        Tracking("p", "e", default_backend=["file"])
    assert not (isolated / "spool").exists() and not (isolated / "logs").exists()


def test_a_run_id_one_typo_from_a_mode_word_resumes_only_a_run_that_exists(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``OTEL_TRACKING_RESUME=atuo`` used to start a run whose id was ``atuo``; now it is an error,
    unless a run of that id exists (then it is that run's id, not a typo)."""
    with pytest.raises(ConfigError, match="did you mean 'auto'"):
        Tracking("p", "e", default_backend=[], resume="atuo")
    assert not (isolated / "spool").exists()
    monkeypatch.setenv("OTEL_TRACKING_RUN_ID", "atuo")
    Tracking("p", "e", default_backend=[]).finish()
    monkeypatch.delenv("OTEL_TRACKING_RUN_ID")
    again = Tracking("p", "e", default_backend=[], resume="atuo")
    again.finish()
    assert again.run_id == "atuo" and again._run is not None and again._run.settings.attempt == 2
    fresh = Tracking("p", "e", default_backend=[], resume="run-7")  # no typo: a new run of that id
    fresh.finish()
    assert fresh.run_id == "run-7"


def test_an_unwritable_spool_directory_is_one_warning_at_tracking_and_drops_are_counted(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """It showed only at the first spool, as a traceback; now ``Tracking()`` says once what it
    costs, and what could not be spooled is counted dropped."""
    blocker = isolated / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("OTEL_TRACKING_SPOOL_DIR", str(blocker / "spool"))
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{_closed_port()}/v1/traces")
    monkeypatch.setenv("OTEL_TRACKING_MAX_ATTEMPTS", "1")
    from otel_tracking import trace_state

    caplog.set_level(logging.WARNING, logger="otel_tracking")
    tracking = Tracking("p", "e", default_backend=[])
    spool_warnings = [r for r in caplog.records if "spool directory" in r.getMessage()]
    assert len(spool_warnings) == 1
    message = spool_warnings[0].getMessage()
    assert str(blocker / "spool") in message and "dropped instead of kept" in message and "cannot resume" in message
    with trace_state("phase"):
        pass
    tracking.log({"x": 1.0}, 1)
    stats = tracking.finish()
    assert stats["otlp-traces"]["dropped"] == 2 and stats["otlp-traces"]["spooled"] == 0  # the phase and its root
    assert not any(r.exc_info for r in caplog.records), "no traceback"
    assert [r for r in caplog.records if "spool directory" in r.getMessage()] == spool_warnings


def _closed_port() -> int:
    from tests.conftest import free_port

    return free_port()


# --- names that become paths (item 14) ---------------------------------------------------------

names = st.text(alphabet=st.characters(codec="utf-8"), max_size=300) | st.sampled_from(
    ["..", ".", "../../etc", "/abs/path", "a/../../b", "", "~", "-", "..\\x", "x" * 400]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(project=names, experiment=names, run_id=names, sink=names, rank=st.none() | st.integers(-5, 10**6))
def test_every_path_made_from_names_stays_in_the_spool_directory(
    isolated: Path, project: str, experiment: str, run_id: str, sink: str, rank: int | None
) -> None:
    root = spool_root().resolve()
    directory = spool_dir(project, experiment, run_id)
    assert directory.resolve().parent.parent == root, directory
    assert all(len(part.encode()) <= 255 for part in directory.relative_to(spool_root()).parts)
    settings_ = build_worker_settings({"ml.project": project, "ml.experiment": experiment, "ml.run.id": run_id})
    assert settings_.spool_dir.resolve().is_relative_to(root)
    spool = sink_spool(Sink(sink or "s"), settings_, pid=1)
    assert spool is not None and spool.path.resolve().parent == settings_.spool_dir.resolve()
    record = RunRecord(directory / record_name(rank), project, experiment, run_id, 1, rank)
    assert record.path.resolve().parent == directory.resolve()


def test_distinct_long_names_keep_distinct_directories() -> None:
    a, b = "x" * 200 + "a", "x" * 200 + "b"
    assert spool_dir(a, "e", "r") != spool_dir(b, "e", "r")
    assert spool_dir("p", a, "r") != spool_dir("p", b, "r")


def test_a_driver_run_id_that_would_leave_its_directory_is_refused_and_a_workers_is_encoded(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACKING_RUN_ID", "../../etc")
    with pytest.raises(ConfigError, match=re.escape("OTEL_TRACKING_RUN_ID='../../etc' is not a run id")):
        Tracking("p", "e", default_backend=[])
    monkeypatch.delenv("OTEL_TRACKING_RUN_ID")
    assert not (isolated / "spool").exists() and not (isolated / "etc").exists()
    # A worker's run id comes from another process's baggage: used as it is, its path made safe.
    worker = build_worker_settings({"ml.run.id": "../../etc", "ml.project": "..", "ml.experiment": "../x"})
    assert worker.run_id == "../../etc"
    assert worker.spool_dir.resolve().is_relative_to(spool_root().resolve())
    tracking = Tracking("..", "../../x", default_backend=[])  # project and experiment: any text, as the reference
    tracking.finish()
    assert tracking._run is not None
    record = tracking._run.settings.spool_dir / "run.json"
    assert record.is_file() and record.resolve().is_relative_to((isolated / "spool").resolve())
    assert sorted(p.name for p in (isolated / "spool").iterdir()) == ["__"]


def test_build_settings_names_no_path_outside_the_root_for_printable_names() -> None:
    for project in [*string.punctuation, "..", "../.."]:
        s = build_settings(project, project, ())
        assert s.spool_dir.resolve().is_relative_to(spool_root().resolve()), project


def test_keys_checked_at_one_step_are_checked_again_at_the_next(isolated: Path) -> None:
    """log() checks a run's key list once and then takes float steps with those keys whole: a key
    that only looks the same (a str subclass) is still refused, and a step with other values is
    still split by the rules."""
    import numpy as np

    class Key(str):
        pass

    os.environ["VERL_FILE_LOGGER_ROOT"] = str(isolated / "logs")
    tracking = Tracking("p", "e", default_backend=["file"])
    try:
        tracking.log({"x": 1.0, "y": 2.0}, 1)
        with pytest.raises(TypeError, match="keys must be str"):
            tracking.log({Key("x"): 1.0, "y": 2.0}, 2)
        tracking.log({"x": np.float32(1.5), "y": True}, 3)
        tracking.log({"x": 3.0, "y": "text"}, 4)
    finally:
        tracking.finish()
        del os.environ["VERL_FILE_LOGGER_ROOT"]
    lines = (isolated / "logs" / "p" / "e.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "data": {"x": 1.0, "y": 2.0}},
        {"step": 3, "data": {"x": 1.5, "y": True}},
        {"step": 4, "data": {"x": 3.0, "y": "text"}},
    ]
