"""Stall reports (issue 32): a phase that outlives its bound is said while it is still stuck: which
process, which phase and step, how long, and the line it is stuck in, with every thread's stack.

The stuck processes are real scripts in child processes, stuck in a GIL-releasing wait and in a
pure-Python loop; the reports are read while they are still stuck, from the file sink's events
file, a real OTLP receiver and TensorBoard's own reader, and through ``otel-tracking stalls``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from otel_tracking.runtime.stalls import LEARNED_FACTOR, StallWatch
from tests.otlp_receiver import HttpReceiver, wait_for

STUCK = textwrap.dedent(
    """
    import os, sys, threading, time
    from otel_tracking import Tracking, trace_state

    how, flag = sys.argv[1], sys.argv[2]
    t = Tracking("proj", "exp", default_backend=["file", "tensorboard"]) if how != "worker" else None
    for step in (1, 2, 3):
        with trace_state("update_actor", step=step):
            if step == 3:
                if how == "busy":
                    while not os.path.exists(flag):  # stuck in Python: a loop that never yields
                        pass
                else:
                    while not os.path.exists(flag):
                        threading.Event().wait(0.05)  # stuck in a GIL-releasing wait
        if t is not None:
            t.log({"loss": float(step)}, step)
    if t is not None:
        t.finish()
    """
)
STUCK_LINE = {"wait": "threading.Event().wait(0.05)", "busy": "while not os.path.exists(flag)"}


def _env(root: Path, receiver: HttpReceiver, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_", "TENSORBOARD_"))}
    env.update(
        {
            "OTEL_TRACKING_SPOOL_DIR": str(root / "spool"),
            "VERL_FILE_LOGGER_ROOT": str(root / "logs"),
            "TENSORBOARD_DIR": str(root / "tb"),
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BLRP_SCHEDULE_DELAY": "100",
            "OTEL_TRACKING_START_TIMEOUT": "120",
        }
    )
    env.update(extra)
    return env


def _stalls_in(events: Path) -> list[dict[str, Any]]:
    if not events.exists():
        return []
    found = []
    for line in events.read_text().splitlines():
        if '"ml.stall"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:  # the line being written as we read
            continue
        if record.get("event_name") == "ml.stall":
            found.append(record)
    return found


def _otlp_stalls(receiver: HttpReceiver) -> list[dict[str, Any]]:
    return [r for r in receiver.received.log_records() if r.get("event_name") == "ml.stall"]


def _stuck_run(tmp_path: Path, how: str) -> None:
    flag = tmp_path / "come-back"
    events = tmp_path / "logs" / "proj" / "exp.events.jsonl"
    with HttpReceiver() as receiver:
        env = _env(tmp_path, receiver, OTEL_TRACKING_STALL_AFTER="2")
        child = subprocess.Popen(
            [sys.executable, "-c", STUCK, how, str(flag)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            started = time.monotonic()
            (first, *_) = wait_for(lambda: _stalls_in(events), timeout_s=60, what="a stall report in the events file")
            assert child.poll() is None, "reported while the phase is still stuck"
            otlp = wait_for(lambda: _otlp_stalls(receiver), timeout_s=30, what="the stall report over OTLP")
            assert child.poll() is None
        finally:
            flag.touch()
        _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert time.monotonic() - started < 60

    attributes = first["attributes"]
    assert attributes["ml.phase"] == "update_actor" and attributes["ml.step"] == 3
    assert 2.0 <= attributes["ml.stall.open_s"] < 2.0 + 15, attributes
    assert attributes["ml.stall.bound_s"] == 2.0 and attributes["ml.stall.report"] == 1
    assert attributes["thread.name"] == "MainThread"
    assert attributes["ml.stall.frame"].startswith("<string>:"), attributes  # the script's own line
    assert first["severity"] == "WARN"
    assert first["resource"]["process.pid"] == child.pid
    body = first["body"]
    assert body.startswith("Thread ") and "(opened 'update_actor'; stuck here)" in body.splitlines()[0]
    assert STUCK_LINE[how].split("(")[0] in body or 'File "<string>"' in body, body
    spans = [json.loads(line) for line in events.read_text().splitlines() if '"type":"span"' in line]
    (phase,) = [s for s in spans if s["name"] == "update_actor" and s["attributes"].get("ml.step") == 3]
    assert (first["trace_id"], first["span_id"]) == (phase["trace_id"], phase["span_id"]), "the stuck span's ids"

    (over_otlp, *_) = otlp
    assert over_otlp["attributes"]["ml.phase"] == "update_actor" and over_otlp["attributes"]["ml.step"] == 3
    assert "stuck here" in over_otlp["body"]

    # the first report's own age: 2 s, or more on a loaded machine
    said = f"phase 'update_actor' at step 3 open {attributes['ml.stall.open_s']:.0f} s (bound 2 s)"
    assert "otel-tracking: stall: process (pid" in err and said in err, err

    shown = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "stalls", str(tmp_path / "logs")], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown  # it came back: no stall is open at the end
    assert "1 stuck phase(s) in 1 events file(s): 1 recovered, 0 still open at the end" in shown.stdout
    (row,) = [line for line in shown.stdout.splitlines() if "update_actor" in line]
    assert f" {child.pid} " in row and " 3 " in row and "<string>:" in row and " recovered after " in row

    from tests.test_backend_tensorboard import read_events

    _, texts, _ = read_events(tmp_path / "tb")
    (tag,) = [t for t in texts if t.startswith("ml.stall/update_actor")]
    (report_step, text), *_ = texts[tag]
    assert report_step == 3 and "**stall**: phase update_actor at step 3 open " in text and "stuck here" in text


def test_a_rank_stuck_in_a_gil_releasing_wait_is_reported_while_stuck(tmp_path: Path) -> None:
    _stuck_run(tmp_path, "wait")


def test_a_rank_stuck_in_a_pure_python_loop_is_reported_while_stuck(tmp_path: Path) -> None:
    _stuck_run(tmp_path, "busy")


def test_a_worker_process_without_tracking_reports_its_own_stall_over_otlp(tmp_path: Path) -> None:
    flag = tmp_path / "come-back"
    with HttpReceiver() as receiver:
        env = _env(tmp_path, receiver, OTEL_TRACKING_STALL_AFTER="1", RANK="5", OTEL_TRACKING_ROLE="actor")
        child = subprocess.Popen(
            [sys.executable, "-c", STUCK, "worker", str(flag)], env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True
        )
        try:
            (record, *_) = wait_for(lambda: _otlp_stalls(receiver), timeout_s=60, what="the worker's stall report")
            assert child.poll() is None
        finally:
            flag.touch()
        _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert record["resource"]["ml.rank"] == 5 and record["resource"]["ml.role"] == "actor"
    assert record["attributes"]["ml.phase"] == "update_actor" and record["attributes"]["ml.step"] == 3
    assert "otel-tracking: stall: actor rank 5 (pid" in err


def test_reports_are_off_with_stall_after_zero(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import threading, time
        from otel_tracking import Tracking, trace_state
        t = Tracking("proj", "exp", default_backend=["file"])
        with trace_state("rollout", step=1):
            time.sleep(1.5)
        assert not [th for th in threading.enumerate() if th.name == "otel-tracking-stall-watch"]
        t.log({"x": 1.0}, 1)
        t.finish()
        """
    )
    with HttpReceiver() as receiver:
        env = _env(tmp_path, receiver, OTEL_TRACKING_STALL_AFTER="0", OTEL_TRACKING_STALL_FLOOR="0.5")
        done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _stalls_in(tmp_path / "logs" / "proj" / "exp.events.jsonl") == []
    assert "stall" not in done.stderr


def _span_started(provider: TracerProvider, name: str, start_ns: int) -> Any:
    return provider.get_tracer("t").start_span(name, start_time=start_ns)


def test_the_learned_bound_never_fires_on_a_healthy_run_whose_phases_vary_30x() -> None:
    """Model of a healthy run: each phase lasts 3 ms to 90 ms at random (30x apart), checked as the
    watcher would, at every 10 ms of its life; no report.  Then a phase open for longer than 40x
    its slowest completed duration is reported, once, and again only when its open time doubles."""
    import random

    reports: list[Any] = []
    watch = StallWatch(after_s=None, floor_s=0.01, report=reports.append)
    provider = TracerProvider()
    rng = random.Random(7)
    now = 1_000_000_000_000
    for i in range(300):  # the shortest first, then the longest: the 30x jump the bound must allow
        duration_s = [0.003, 0.09][i] if i < 2 else rng.choice([0.003, 0.09, rng.uniform(0.003, 0.09)])
        span = _span_started(provider, "generate", now)
        for t in range(0, int(duration_s * 1000), 10):
            watch.check({span: 1}, now + t * 1_000_000)
        now += int(duration_s * 1e9)
        span.end(end_time=now)
        watch.ended("generate", duration_s)
    assert reports == [], "a healthy run's phases stayed under the learned bound"
    bound = watch.bound_s("generate")
    assert abs(bound - LEARNED_FACTOR * 0.09) < 1e-9, bound
    assert watch.bound_s("never-ended") == 0.01, "the floor for a phase never seen to end"

    stuck = _span_started(provider, "generate", now)
    seen = [
        watch.check({stuck: 1}, now + int(s * 1e9))
        for s in (bound - 0.01, bound + 1e-3, bound + 1, 2 * bound + 1e-3, 4 * bound + 1e-3)
    ]
    assert [len(found) for found in seen] == [0, 1, 0, 1, 1]
    assert [r.report for r in reports] == [1, 2, 3]
    assert reports[0].phase == "generate" and reports[0].bound_s == round(bound, 3)  # as reported, to the ms
    watch.check({}, now)  # it ended: forgotten
    assert watch._due == {}


@pytest.mark.parametrize("open_s", [2.5004, 2.4996, 3.4999, 2.0001])
def test_the_line_on_stderr_and_the_record_say_the_same_age(open_s: float) -> None:
    """A person reads the line, a tool the record: both from one number, also at a rounding edge."""
    from otel_tracking.runtime.stall_report import make_stall, stall_line

    span = _span_started(TracerProvider(), "update_actor", 1)
    stall = make_stall("update_actor", [(open_s, span, None)], 2.0, 1)
    recorded = stall.attributes()["ml.stall.open_s"]
    assert f"open {recorded:.0f} s (bound 2 s)" in stall_line(stall, {})


def test_the_trackers_show_a_stall_the_way_their_users_watch_for_one(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow: a tag on the run (the runs table) and the report as a text artifact; wandb: an alert
    (what wandb sends to Slack or email), recorded in the offline run for ``wandb sync``; Trackio:
    an alert (its dashboard, a webhook), read back through its own storage."""
    from otel_tracking import Tracking, trace_state
    from tests import readers_mlflow, readers_wandb

    uri = f"sqlite:///{isolated / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("OTEL_TRACKING_STALL_AFTER", "1")
    monkeypatch.setenv("OTEL_TRACKING_START_TIMEOUT", "120")
    monkeypatch.setenv("TRACKIO_DIR", str(isolated / "trackio"))
    tracking = Tracking("proj", "exp", default_backend=["mlflow", "wandb", "trackio"])
    tracking.log({"loss": 1.0}, 1)
    with trace_state("update_actor", step=2):
        time.sleep(1.6)
    tracking.log({"loss": 0.5}, 2)
    tracking.finish()

    client = readers_mlflow.client(uri)
    run = readers_mlflow.only_run(client, client.get_experiment_by_name("proj").experiment_id)
    tag = run.data.tags["ml.stall.update_actor"]
    assert tag.startswith("phase update_actor at step 2 open ") and "(bound 1.0 s, report 1), in " in tag, tag
    text = client.download_artifacts(run.info.run_id, "stalls/update_actor-step2-report1.md", str(isolated))
    assert "stuck here" in Path(text).read_text() and "test_stalls.py" in Path(text).read_text()

    wandb_run = readers_wandb.only_run(isolated / "wandb")
    alerts = [r.alert for r in wandb_run.records if r.WhichOneof("record_type") == "alert"]
    assert [(a.title, a.level) for a in alerts] == [("stall: update_actor at step 2", "WARN")], alerts
    assert alerts[0].text.startswith("phase update_actor at step 2 open ")

    reader = (
        "import json, sys\nfrom trackio.sqlite_storage import SQLiteStorage\n"
        "print(json.dumps(SQLiteStorage.get_alerts('proj', run_name='exp')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", reader],
        env={**os.environ, "TRACKIO_DIR": str(isolated / "trackio")},
        capture_output=True,
        text=True,
        check=True,
    )
    (trackio_alert,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert trackio_alert["title"] == "stall: update_actor at step 2" and trackio_alert["level"] == "warn", trackio_alert
    assert trackio_alert["text"].startswith("phase update_actor at step 2 open ") and trackio_alert["step"] == 2


def test_swanlab_and_clearml_show_a_stall_as_text(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, clearml_config_file: Path
) -> None:
    """SwanLab: a text entry ``ml.stall/<phase>`` at the step (its media panel); ClearML: a
    WARNING in the task's console (its Console tab); each read back from its own offline store."""
    from otel_tracking import Tracking, trace_state
    from tests import readers_clearml, readers_swanlab

    monkeypatch.setenv("OTEL_TRACKING_STALL_AFTER", "1")
    monkeypatch.setenv("OTEL_TRACKING_START_TIMEOUT", "120")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(isolated / "swanlog"))
    monkeypatch.setenv("HOME", str(isolated / "home"))
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(clearml_config_file))
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    tracking = Tracking("proj", "exp", default_backend=["swanlab", "clearml"])
    tracking.log({"loss": 1.0}, 1)
    with trace_state("update_actor", step=2):
        time.sleep(1.6)
    tracking.log({"loss": 0.5}, 2)
    tracking.finish()

    (run,) = readers_swanlab.wait_for_run(isolated / "swanlog")
    (media,) = [(step, files) for key, step, files in run.media if key == "ml.stall/update_actor"]
    assert media[0] == 2
    text = (run.path / "media" / "text" / media[1][0]).read_text()
    assert text.startswith("**stall**: phase update_actor at step 2 open ") and "stuck here" in text

    (session,) = readers_clearml.wait_for_sessions(isolated / "home")
    warnings = [msg for level, msg in session.logs if level == "warning" and "**stall**" in msg]
    assert len(warnings) == 1 and "phase update_actor at step 2 open " in warnings[0], session.logs
    assert "stuck here" in warnings[0]


# --- what leaves the process: scrubbed, bounded, one report per phase, never an unbounded wait ---

SECRET_PHASE = "download https://alice:s3cr3t-pw@db.example.com/shard"
SECRET_LANE = "https://bob:hunter2-pw@lane.example.com/0"
SECRETS = ("s3cr3t-pw", "hunter2-pw", "alice:", "bob:")


def _stalls_of(events: Path, phase: str | None = None) -> list[dict[str, Any]]:
    return [r for r in _stalls_in(events) if phase is None or r["attributes"].get("ml.phase") == phase]


def _in_process(isolated: Path, monkeypatch: pytest.MonkeyPatch, after_s: str) -> Path:
    monkeypatch.setenv("OTEL_TRACKING_STALL_AFTER", after_s)
    monkeypatch.setenv("OTEL_TRACKING_START_TIMEOUT", "120")
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(isolated / "logs"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{isolated / 'mlflow.db'}")
    return isolated / "logs" / "proj" / "exp.events.jsonl"


def _wandb_alerts(root: Path) -> list[Any]:
    from tests import readers_wandb

    return [r.alert for r in readers_wandb.only_run(root / "wandb").records if r.WhichOneof("record_type") == "alert"]


def test_a_secret_in_a_phase_or_lane_reaches_no_line_record_alert_or_file_name(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A phase named after the URL it downloads, with a password in it, on a lane named alike: the
    stderr line, the ml.stall record, the wandb alert and the MLflow tag and artifact (its name
    too) all say ``<redacted>`` where the credentials were."""
    from otel_tracking import Tracking, trace_state
    from tests import readers_mlflow

    events = _in_process(isolated, monkeypatch, "0.5")
    tracking = Tracking("proj", "exp", default_backend=["file", "mlflow", "wandb"])
    with trace_state(SECRET_PHASE, state_lane_id=SECRET_LANE, step=1):
        wait_for(lambda: _stalls_of(events), timeout_s=60, what="the stall report")
    tracking.log({"loss": 1.0}, 1)
    tracking.finish()
    err = capfd.readouterr().err

    (line,) = [line for line in err.splitlines() if "otel-tracking: stall:" in line]
    assert "phase 'download https://<redacted>@db.example.com/shard' lane https://<redacted>@lane" in line, line
    said = [err, events.read_text()]
    client = readers_mlflow.client(f"sqlite:///{isolated / 'mlflow.db'}")
    run = readers_mlflow.only_run(client, client.get_experiment_by_name("proj").experiment_id)
    said += [f"{k}={v}" for k, v in run.data.tags.items()]
    (artifact,) = client.list_artifacts(run.info.run_id, "stalls")
    said.append(artifact.path)
    said.append(Path(client.download_artifacts(run.info.run_id, artifact.path, str(isolated))).read_text())
    (alert,) = _wandb_alerts(isolated)
    said += [alert.title, alert.text]
    assert "<redacted>" in alert.title and "_redacted_" in artifact.path, (alert.title, artifact.path)
    for text in said:
        for secret in SECRETS:
            assert secret not in text, (secret, text[:2000])


FORKS = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from otel_tracking import Tracking, trace_state
    from otel_tracking.runtime import stalls

    def child():
        with trace_state("load_batch", step=1):  # the child's first phase takes the watcher's lock
            pass
        os._exit(0)

    t = Tracking("proj", "exp", default_backend=["file"])
    with trace_state("rollout", step=1):
        pass
    how = sys.argv[1]
    with stalls._watcher.lock:  # held at the fork, as the watcher thread holds it once a second
        if how == "os.fork":
            pid = os.fork()
            if pid == 0:
                child()
        else:
            process = multiprocessing.get_context("fork").Process(target=child)
            process.start()
    deadline = time.monotonic() + 60  # a bounded wait: a child deadlocked in trace_state never ends
    code = None
    while code is None and time.monotonic() < deadline:
        if how == "os.fork":
            done, status = os.waitpid(pid, os.WNOHANG)
            code = os.waitstatus_to_exitcode(status) if done else None
        else:
            process.join(0.1)
            code = process.exitcode
        time.sleep(0.02)
    if code is None:
        os.kill(pid if how == "os.fork" else process.pid, 9)
    print("child exit", code)
    t.finish()
    """
)


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_a_child_forked_while_the_watcher_holds_its_lock_runs_its_phases(tmp_path: Path, how: str) -> None:
    with HttpReceiver() as receiver:
        done = subprocess.run(
            [sys.executable, "-c", FORKS, how],
            env=_env(tmp_path, receiver, OTEL_TRACKING_STALL_AFTER="30"),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    assert "child exit 0" in done.stdout, (done.stdout, done.stderr[-3000:])


def test_a_lookup_that_never_answers_costs_its_report_the_answer_not_the_watcher(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """What a phase waits for is asked of a source that hangs (a Ray GCS that does not answer): the
    report still goes out, saying whom it waits for is not known, and later reports too."""
    from otel_tracking import Tracking, trace_state
    from otel_tracking.runtime import stall_report as report

    gcs_answers = threading.Event()

    def hung_gcs(span: Any) -> Any:
        gcs_answers.wait()  # never, until the test ends
        return None

    monkeypatch.setattr(report, "_waiting_sources", [hung_gcs])
    monkeypatch.setattr(report, "_lookup", report._Lookup())
    events = _in_process(isolated, monkeypatch, "0.3")
    tracking = Tracking("proj", "exp", default_backend=["file"])
    try:
        with trace_state("update_actor", step=1):
            (first, *_) = wait_for(lambda: _stalls_of(events, "update_actor"), timeout_s=60, what="the first report")
        with trace_state("gen", step=2):
            (second, *_) = wait_for(lambda: _stalls_of(events, "gen"), timeout_s=60, what="a later report")
    finally:
        gcs_answers.set()
    tracking.finish()
    assert "did not answer within" in first["attributes"]["ml.stall.waiting_unknown"]
    assert first["body"].startswith("Whom it waits for: not known")
    assert "an earlier lookup has not answered" in second["attributes"]["ml.stall.waiting_unknown"]
    assert "whom it waits for: not known" in capfd.readouterr().err


def test_two_thousand_stuck_lanes_make_one_report_alerts_are_limited_and_no_artifact_is_overwritten(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 lanes of one phase stuck at once: one record per report time (the lanes counted and
    named, boundedly), not one per lane.  Twelve phases stuck at once: wandb gets at most the
    alert limit's burst.  One phase stuck twice at one step: two MLflow artifacts."""
    from contextlib import ExitStack

    from otel_tracking import Tracking, trace_state
    from otel_tracking.exporters._base import AlertLimit
    from otel_tracking.runtime.stall_report import MAX_LISTED
    from tests import readers_mlflow

    events = _in_process(isolated, monkeypatch, "0.5")
    tracking = Tracking("proj", "exp", default_backend=["file", "mlflow", "wandb"])
    with ExitStack() as lanes:
        for lane in range(2000):
            lanes.enter_context(trace_state("generate", state_lane_id=f"replica_{lane}", step=1))
        (report, *_) = wait_for(
            lambda: [r for r in _stalls_of(events, "generate") if r["attributes"]["ml.stall.spans"] == 2000],
            timeout_s=60,
            what="a report with every lane past the bound",
        )
    tracking.log({"loss": 1.0}, 1)
    for _ in range(2):  # stuck, back, stuck again, at one step
        with trace_state("fetch", step=2):
            seen = len(_stalls_of(events, "fetch"))
            wait_for(lambda seen=seen: len(_stalls_of(events, "fetch")) > seen, timeout_s=60, what="fetch's report")
    tracking.log({"loss": 0.5}, 2)
    with ExitStack() as phases:
        for index in range(12):
            phases.enter_context(trace_state(f"phase_{index}", step=3))
        wait_for(lambda: all(_stalls_of(events, f"phase_{i}") for i in range(12)), timeout_s=60, what="12 reports")
    tracking.log({"loss": 0.25}, 3)
    tracking.finish()

    generate = _stalls_of(events, "generate")
    open_s = max(r["attributes"]["ml.stall.open_s"] for r in generate)
    assert len(generate) <= 2 + math.log2(max(open_s / 0.5, 1)), [r["attributes"]["ml.stall.open_s"] for r in generate]
    attributes = report["attributes"]
    assert attributes["ml.stall.spans"] == 2000 and len(attributes["ml.stall.lanes"]) == MAX_LISTED
    assert "2000 spans of 'generate'" in report["body"]
    for record in _stalls_in(events):
        assert len(json.dumps(record)) < 64_000

    client = readers_mlflow.client(f"sqlite:///{isolated / 'mlflow.db'}")
    run = readers_mlflow.only_run(client, client.get_experiment_by_name("proj").experiment_id)
    names = [a.path for a in client.list_artifacts(run.info.run_id, "stalls")]
    assert "stalls/fetch-step2-report1.md" in names and "stalls/fetch-step2-report1-2.md" in names, names
    assert len(names) == len(_stalls_in(events)), "one artifact per report, none written over another"

    alerts = _wandb_alerts(isolated)
    assert 0 < len(alerts) <= AlertLimit().burst, [a.title for a in alerts]
    assert len({a.title for a in alerts}) == len(alerts), "one alert per phase and step at most"


def test_a_record_stays_bounded_at_any_rank_count(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver waiting for 4,096 ranks (as verl's source names them: one line per rank): the
    record's body stays under its cap, and its rank lists are cut, with the counts kept."""
    from otel_tracking import Tracking, trace_state
    from otel_tracking.runtime import stall_report as report

    ranks = 4096

    def many_ranks(span: Any) -> report.Waiting:
        lines = tuple(f"  rank {r}: actor {'f' * 32} (ALIVE), node {'e' * 56} (10.0.0.1), pid {r}" for r in range(4096))
        return report.Waiting(waiting=tuple(range(1, ranks, 2)), done=tuple(range(0, ranks, 2)), lines=lines)

    monkeypatch.setattr(report, "_waiting_sources", [many_ranks])
    events = _in_process(isolated, monkeypatch, "0.3")
    tracking = Tracking("proj", "exp", default_backend=["file"])
    with trace_state("update_actor", step=1):
        (record, *_) = wait_for(lambda: _stalls_of(events), timeout_s=60, what="the report")
    tracking.finish()
    assert len(record["body"]) <= report.MAX_BODY_CHARS, len(record["body"])
    attributes = record["attributes"]
    assert attributes["ml.stall.waiting_count"] == ranks // 2 and attributes["ml.stall.done_count"] == ranks // 2
    assert len(attributes["ml.stall.waiting_ranks"]) == report.MAX_LISTED
    assert len(json.dumps(record)) < report.MAX_BODY_CHARS + 8_000


RECOVERS_THEN_HANGS = textwrap.dedent(
    """
    import os, sys, threading
    from otel_tracking import Tracking, trace_state

    back, stop = sys.argv[1], sys.argv[2]
    t = Tracking("proj", "exp", default_backend=["file"])
    with trace_state("update_actor", step=1):  # stuck, then back
        while not os.path.exists(back):
            threading.Event().wait(0.05)
    t.log({"loss": 1.0}, 1)
    with trace_state("save_checkpoint", step=2):  # stuck until the job gives up: finish() inside it
        while not os.path.exists(stop):
            threading.Event().wait(0.05)
        t.finish()
    """
)


def test_stalls_says_which_recovered_after_how_long_and_which_were_open_at_the_end(tmp_path: Path) -> None:
    back, stop = tmp_path / "back", tmp_path / "stop"
    events = tmp_path / "logs" / "proj" / "exp.events.jsonl"
    with HttpReceiver() as receiver:
        child = subprocess.Popen(
            [sys.executable, "-c", RECOVERS_THEN_HANGS, str(back), str(stop)],
            env=_env(tmp_path, receiver, OTEL_TRACKING_STALL_AFTER="1"),
            cwd=tmp_path,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: _stalls_of(events, "update_actor"), timeout_s=60, what="update_actor's report")
            back.touch()
            wait_for(lambda: _stalls_of(events, "save_checkpoint"), timeout_s=60, what="save_checkpoint's report")
        finally:
            back.touch()
            stop.touch()
        _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err

    shown = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "stalls", str(tmp_path / "logs")], capture_output=True, text=True
    )
    assert shown.returncode == 1, shown  # one stall still open at the end
    assert "2 stuck phase(s) in 1 events file(s): 1 recovered, 1 still open at the end" in shown.stdout, shown.stdout
    (recovered,) = [line for line in shown.stdout.splitlines() if "update_actor" in line]
    (still_open,) = [line for line in shown.stdout.splitlines() if "save_checkpoint" in line]
    assert " recovered after " in recovered and " open at the end (ended by finish) " in still_open, shown.stdout


def test_a_phase_waiting_for_ranks_to_start_is_not_a_stall_and_its_clock_starts_when_they_have(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Model of a driver whose first ``update_actor`` waits for the worker group's actors to start:
    while ranks have not started, no report (a 'waiting to start' note instead), however long; once
    they have, the phase is reported only if it stays open a whole bound longer."""
    from otel_tracking.runtime import stall_report as report

    started = threading.Event()

    def ranks(span: Any) -> report.Waiting:
        return report.Waiting(waiting=(0, 1), starting=() if started.is_set() else (0, 1))

    monkeypatch.setattr(report, "_waiting_sources", [ranks])
    reports: list[Any] = []
    notes: list[Any] = []
    watch = StallWatch(after_s=4.0, floor_s=300.0, report=reports.append, starting=notes.append)
    span = _span_started(TracerProvider(), "update_actor", 0)
    for second in range(0, 40):  # 40 s of ranks starting: looked at every second
        watch.check({span: threading.get_ident()}, second * 1_000_000_000)
    assert reports == [] and [round(n.open_s) for n in notes] == [4, 8, 16, 32], "said when found, then as it doubles"
    assert "waiting for 2 rank(s) to start (0, 1); not a stall" in report.starting_line(notes[0], {})
    started.set()  # they started after 39 s; the call itself now runs
    for second in range(40, 43):
        watch.check({span: threading.get_ident()}, second * 1_000_000_000)
    assert reports == [], "a bound after the ranks were last seen starting, not before"
    watch.check({span: threading.get_ident()}, 43 * 1_000_000_000)
    (stall,) = reports
    assert stall.report == 1 and stall.waiting.waiting == (0, 1)
