"""Resume (issue 13): a job killed at step 130 and restarted from its step-100 checkpoint continues the
same run in every tracker and in OpenTelemetry.

The big test runs two real jobs as subprocesses, every backend offline: the first logs steps 1..130
and is SIGKILLed once everything it logged was delivered (it prints a line then: the test waits on
that line, not on a sleep); the second, with ``OTEL_TRACKING_RESUME=auto``, logs 101..200 and
finishes.  Each backend is read back through its own reader.  The second job logs other values at
101..130 (``+ 0.5``), so each backend's rule for overlapping steps can be seen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_tracking import Tracking
from otel_tracking.config.settings import ConfigError
from otel_tracking.exporters.file import read_metrics
from tests import readers_clearml, readers_mlflow, readers_swanlab, readers_wandb
from tests.otlp_receiver import HttpReceiver, wait_for
from tests.servers import process_gone
from tests.test_backend_tensorboard import read_events

ALL = ["file", "tensorboard", "mlflow", "wandb", "swanlab", "clearml", "trackio"]

JOB = textwrap.dedent(
    """
    import json, os, sys, time
    from otel_tracking import Tracking, trace_state

    first, last, offset, mode = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    backends = sys.argv[5].split(",")
    t = Tracking("proj", "exp", default_backend=backends, config={"lr": 0.1})
    for step in range(first, last + 1):
        with trace_state("rollout"):
            pass
        t.log({"loss": step + offset}, step)
    if mode == "kill":
        assert t.flush(timeout_s=300)  # every step delivered by the bridge process (or spooled)
        bridge = t.logger[backends[-1]].link.process.pid if hasattr(t.logger[backends[-1]], "link") else 0
        print(json.dumps({"run_id": t.run_id, "bridge": bridge}), flush=True)
        time.sleep(600)
    stats = t.finish()
    print(json.dumps({"run_id": t.run_id, "stats": stats}), flush=True)
    """
)


def _job_env(root: Path, clearml_config_file: Path, endpoint: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "WANDB_", "MLFLOW_", "SWANLAB_"))}
    for sub in ("wandb", "wandb/cache", "wandb/data", "wandb/config", "home"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env.update(
        {
            "OTEL_TRACKING_SPOOL_DIR": str(root / "spool"),
            "OTEL_TRACKING_START_TIMEOUT": "300",
            "VERL_FILE_LOGGER_PATH": str(root / "metrics.jsonl"),
            "TENSORBOARD_DIR": str(root / "tb"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_DIR": str(root / "wandb"),
            "WANDB_CACHE_DIR": str(root / "wandb/cache"),
            "WANDB_DATA_DIR": str(root / "wandb/data"),
            "WANDB_CONFIG_DIR": str(root / "wandb/config"),
            "SWANLAB_MODE": "offline",
            "SWANLAB_LOG_DIR": str(root / "swanlog"),
            "HOME": str(root / "home"),
            "CLEARML_CONFIG_FILE": str(clearml_config_file),
            "CLEARML_OFFLINE_MODE": "1",
            "TRACKIO_DIR": str(root / "trackio"),
        }
    )
    if endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
        env["OTEL_METRIC_EXPORT_INTERVAL"] = "100"
    return env


TRACKIO_READER = textwrap.dedent(
    """
    import json, sys
    from trackio.sqlite_storage import SQLiteStorage

    project, run, key = sys.argv[1:4]
    values = [(v["step"], v["value"]) for v in SQLiteStorage.get_metric_values(project, run, key)]
    print(json.dumps([SQLiteStorage.get_runs(project), values]))
    """
)


def trackio_metric(directory: Path, project: str, run: str, key: str) -> tuple[list[str], list[Any]]:
    """(runs of the project, (step, value) of ``key`` in row order), through Trackio's own storage; in
    a process of its own, since Trackio reads TRACKIO_DIR once per process."""
    done = subprocess.run(
        [sys.executable, "-c", TRACKIO_READER, project, run, key],
        env={**os.environ, "TRACKIO_DIR": str(directory)},
        capture_output=True,
        text=True,
        check=True,
    )
    runs, values = json.loads(done.stdout.strip().splitlines()[-1])
    return runs, values


def _start(env: dict[str, str], cwd: Path, *args: Any, script: str = JOB) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _first_json_line(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("{"):
            return dict(json.loads(line))
    process.wait()
    raise AssertionError(f"the job ended without reporting (exit {process.returncode}): {process.stderr.read()}")


def kill_after(
    env: dict[str, str], cwd: Path, first: int, last: int, backends: list[str], script: str = JOB
) -> dict[str, Any]:
    """A job that logs first..last, then dies by SIGKILL (and its bridge process ends on its own)."""
    process = _start(env, cwd, first, last, 0.0, "kill", ",".join(backends), script=script)
    report = _first_json_line(process)
    process.kill()
    process.wait()
    if report["bridge"]:  # it finishes the trackers' runs of the dead job (MLflow: FAILED) and exits
        wait_for(lambda: process_gone(report["bridge"]), timeout_s=300, what="the killed job's bridge process to end")
    return report


def finish_after(
    env: dict[str, str], cwd: Path, first: int, last: int, backends: list[str], offset: float, script: str = JOB
) -> Any:
    process = _start(env, cwd, first, last, offset, "finish", ",".join(backends), script=script)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    return report, err


@pytest.fixture
def receiver() -> Iterator[HttpReceiver]:
    with HttpReceiver() as r:
        yield r


def loss(step: int, attempt: int) -> float:
    return step + (0.5 if attempt == 2 else 0.0)


def resumed_values(first_attempt_last: int = 130, restart: int = 100, last: int = 200) -> dict[int, float]:
    """What the run should show when each (key, step) keeps the newest value."""
    return {s: loss(s, 1 if s <= restart else 2) for s in range(1, last + 1)}


def both_attempts(first_attempt_last: int = 130, restart: int = 100, last: int = 200) -> list[tuple[int, float]]:
    """Every point of both attempts, the killed job's first, as backends that keep every point hold them."""
    return [(s, loss(s, 1)) for s in range(1, first_attempt_last + 1)] + [
        (s, loss(s, 2)) for s in range(restart + 1, last + 1)
    ]


def test_a_killed_job_resumed_from_a_checkpoint_continues_one_run_in_every_backend(
    tmp_path: Path, clearml_config_file: Path, receiver: HttpReceiver
) -> None:
    env = _job_env(tmp_path, clearml_config_file, receiver.endpoint)
    killed = kill_after(env, tmp_path, 1, 130, ALL)
    wait_for(
        lambda: any(v == 130 for _, name, _, v, _ in receiver.received.gauge_points() if name == "loss"),
        what="the killed job's last gauge",
    )
    resumed, stderr = finish_after({**env, "OTEL_TRACKING_RESUME": "auto"}, tmp_path, 101, 200, ALL, 0.5)
    run_id = killed["run_id"]
    assert resumed["run_id"] == run_id
    assert f"resuming run {run_id} of proj/exp, attempt 2 (the previous attempt was not finished" in stderr
    expected = resumed_values()

    # file: one file, appended to after a marker line; the newest value of each step wins
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line for line in lines if "resumed_from_step" in line] == [{"resumed_from_step": 100, "attempt": 2}]
    assert [line["step"] for line in lines if "step" in line] == [s for s, _ in both_attempts()]
    assert read_metrics(tmp_path / "metrics.jsonl")["loss"] == expected

    # TensorBoard: the same directory; its reader purges the killed job's steps >= 101
    scalars, _, _ = read_events(tmp_path / "tb")
    assert scalars["loss"] == sorted(expected.items())

    # MLflow: one run, FINISHED, every point kept (101..130 twice: the later one is attempt 2's)
    client = readers_mlflow.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("proj")
    run = readers_mlflow.only_run(client, experiment.experiment_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["ml.run.attempt"] == "2" and run.data.tags["ml.run.attempt.2.first_step"] == "101"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == sorted(both_attempts())
    newest: dict[int, tuple[int, float]] = {}
    for m in history:
        if m.step not in newest or m.timestamp >= newest[m.step][0]:
            newest[m.step] = (m.timestamp, m.value)
    assert {step: value for step, (_, value) in newest.items()} == expected

    # wandb (offline): one run id, one folder per attempt; the second rewinds it to step 100
    files = readers_wandb.run_files(tmp_path / "wandb")
    assert len(files) == 2
    first, second = (readers_wandb.load_run(f) for f in files)
    assert first.run.run_id == second.run.run_id
    assert (second.run.branch_point.run, second.run.branch_point.value) == (first.run.run_id, 100)
    assert second.exit_code == 0
    history_of = {s: v for k, s, v in first.triples() if k == "loss" and s < 101}
    history_of.update({s: v for k, s, v in second.triples() if k == "loss"})
    assert history_of == expected

    # SwanLab (offline): one run id, one folder per attempt (SwanLab makes a new folder per init);
    # the killed attempt ended crashed (by the bridge process), the resumed one finished
    runs = readers_swanlab.wait_for_run(tmp_path / "swanlog", count=2)
    assert len({r.path.name.rsplit("-", 1)[1] for r in runs}) == 1
    assert [r.finish_state for r in runs] == ["RUN_STATE_CRASHED", "RUN_STATE_FINISHED"]
    points = [(step, value) for r in runs for key, step, value in r.scalars if key == "loss"]
    assert points == both_attempts()

    # ClearML (offline): the same task, continued; every report kept, in report order
    (session,) = readers_clearml.wait_for_sessions(tmp_path / "home")
    assert [(i, v) for t, _, i, v in session.scalars if t == "loss"] == both_attempts()

    # Trackio: the same run; every row kept, in order
    runs, values = trackio_metric(tmp_path / "trackio", "proj", "exp", "loss")
    assert runs == ["exp"]
    assert [tuple(v) for v in values] == both_attempts()

    # OTel: one ml.run.id, two attempts, told apart by ml.run.attempt
    spans = receiver.received.spans()
    attempts = {(s["resource"]["ml.run.id"], s["resource"]["ml.run.attempt"]) for s in spans}
    assert attempts == {(run_id, 1), (run_id, 2)}
    gauges = {
        (r["ml.run.id"], r["ml.run.attempt"], v)
        for r, name, _, v, _ in receiver.received.gauge_points()
        if name == "loss"
    }
    assert (run_id, 1, 130) in gauges and (run_id, 2, 200.5) in gauges
    assert not any(attempt == 1 and v > 130 for _, attempt, v in gauges)

    # the record: finished, attempt 2
    (record,) = (tmp_path / "spool" / "proj").glob(f"exp-{run_id}/run.json")
    saved = json.loads(record.read_text())
    assert (saved["state"], saved["attempt"], saved["exit_code"]) == ("finished", 2, 0)
    assert set(saved["backends"]) == {"mlflow", "wandb", "swanlab", "clearml", "trackio"}


VERL_JOB = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from otel_tracking import Tracking

    first, last, offset, mode = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    backends = sys.argv[5].split(",")
    # what verl's RayPPOTrainer.fit hands Tracking (OmegaConf.to_container of its config), in part
    config = {"trainer": {"resume_mode": "auto", "default_local_dir": "checkpoints", "test_freq": 50}}
    t = Tracking("proj", "exp", default_backend=backends, config=config)
    if first > 1:  # val_before_train: verl validates the reloaded checkpoint and logs it at its step
        t.log({"val/score": 1000 + first - 1 + offset}, first - 1)
    for step in range(first, last + 1):
        data = {"loss": step + offset}
        if step % 50 == 0:  # save_freq = test_freq = 50: the checkpoint, then the step's metrics
            Path("checkpoints").mkdir(exist_ok=True)
            Path("checkpoints/latest_checkpointed_iteration.txt").write_text(str(step))
            data["val/score"] = 1000 + step + offset
        t.log(data, step)
    if mode == "kill":
        assert t.flush(timeout_s=300)
        bridge = t.logger[backends[-1]].link.process.pid if hasattr(t.logger[backends[-1]], "link") else 0
        print(json.dumps({"run_id": t.run_id, "bridge": bridge}), flush=True)
        time.sleep(600)
    stats = t.finish()
    print(json.dumps({"run_id": t.run_id, "stats": stats}), flush=True)
    """
)


def test_a_verl_job_resumed_from_its_checkpoint_keeps_the_checkpoints_step(tmp_path: Path) -> None:
    """Issue 31, item 7: verl reloads ``global_step_100`` (its ``latest_checkpointed_iteration.txt``
    says 100), validates it and logs that at step 100 (``val_before_train``, its default), then trains
    from 101.  That first ``log()`` at 100 was read as "the checkpoint was 99": the killed job's step-100
    training metrics were superseded and nobody logged them again.  The checkpoint step now comes from
    verl's own config: the killed job's steps up to 100 stand, its 101..130 are replaced, and at 100
    only the validation logged again is new."""
    env = _job_env(tmp_path, tmp_path / "no-clearml.conf", None)
    backends = ["file", "tensorboard", "wandb"]
    killed = kill_after(env, tmp_path, 1, 130, backends, script=VERL_JOB)
    resumed, stderr = finish_after(
        {**env, "OTEL_TRACKING_RESUME": "auto"}, tmp_path, 101, 200, backends, 0.5, script=VERL_JOB
    )
    assert resumed["run_id"] == killed["run_id"]
    losses = {s: loss(s, 1 if s <= 100 else 2) for s in range(1, 201)}
    score = {50: 1050.0, 100: 1100.5, 150: 1150.5, 200: 1200.5}

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line for line in lines if "resumed_from_step" in line] == [{"resumed_from_step": 100, "attempt": 2}]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert metrics["loss"] == losses, "the killed job's step 100 stands"
    assert metrics["val/score"] == score

    scalars, _, _ = read_events(tmp_path / "tb")
    assert scalars["loss"] == sorted(losses.items())
    # TensorBoard purges by step, not by key: step 100 keeps both validations, the killed job's first
    assert scalars["val/score"] == [(50, 1050.0), (100, 1100.0), (100, 1100.5), (150, 1150.5), (200, 1200.5)]

    first, second = (readers_wandb.load_run(f) for f in readers_wandb.run_files(tmp_path / "wandb"))
    assert (second.run.branch_point.run, second.run.branch_point.value) == (first.run.run_id, 100)
    wandb_loss = {s: v for k, s, v in first.triples() if k == "loss" and s <= 100}
    wandb_loss.update({s: v for k, s, v in second.triples() if k == "loss"})
    assert wandb_loss == losses
    assert "what it logged after step 100 (verl's checkpoint) is replaced" in stderr, stderr


def test_the_checkpoint_step_is_read_as_verl_reads_it(tmp_path: Path) -> None:
    from otel_tracking.config.resume import checkpoint_step

    def trainer(**fields: Any) -> dict[str, Any]:
        return {"trainer": fields}

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("250\n")
    assert checkpoint_step(trainer(resume_mode="auto", default_local_dir="ckpt"), tmp_path) == 250
    assert checkpoint_step(trainer(resume_mode="auto", default_local_dir=str(tmp_path / "ckpt"))) == 250
    assert checkpoint_step(trainer(resume_mode="auto", default_local_dir="none-yet"), tmp_path) is None
    path = "/data/ckpt/global_step_40"
    assert checkpoint_step(trainer(resume_mode="resume_path", resume_from_path=path)) == 40
    assert checkpoint_step(trainer(resume_mode="disable", default_local_dir="ckpt"), tmp_path) is None
    assert checkpoint_step({"lr": 0.1}) is None and checkpoint_step(None) is None


def test_resume_step_from_the_environment_is_used_and_checked(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_tracking.config.settings import build_settings

    assert build_settings("p", "e", (), env={"OTEL_TRACKING_RESUME_STEP": "70"}).resume_step == 70
    for bad in ("-1", "7.5", "inf", "seventy"):
        with pytest.raises(ConfigError, match="OTEL_TRACKING_RESUME_STEP"):
            build_settings("p", "e", (), env={"OTEL_TRACKING_RESUME_STEP": bad})
    _file_env(monkeypatch, isolated)
    first = Tracking("proj", "exp", default_backend=["file"])
    for step in range(1, 11):
        first.log({"loss": float(step)}, step)
    first.finish()
    monkeypatch.setenv("OTEL_TRACKING_RESUME_STEP", "6")
    second = Tracking("proj", "exp", default_backend=["file"], resume="auto")
    second.log({"loss": 60.0}, 6)
    second.log({"loss": 70.0}, 7)
    second.finish()
    assert _lines(isolated, "exp")[10] == {"resumed_from_step": 6, "attempt": 2}
    assert read_metrics(isolated / "logs" / "proj" / "exp.jsonl")["loss"] == {
        **{s: float(s) for s in range(1, 6)},
        6: 60.0,
        7: 70.0,
    }


BRIDGE_LOST = textwrap.dedent(
    """
    import json, os, signal, time
    from otel_tracking import Tracking

    t = Tracking("proj", "exp", default_backend=["mlflow"])
    for step in range(1, 21):
        t.log({"loss": float(step)}, step)
    assert t.flush(timeout_s=300)
    link = t.logger["mlflow"].link
    os.kill(link.process.pid, signal.SIGKILL)  # the bridge process dies: what follows is spooled
    link.process.wait()
    deadline = time.monotonic() + 60
    while not link._dead and time.monotonic() < deadline:
        time.sleep(0.01)
    for step in range(21, 31):
        t.log({"loss": float(step)}, step)
    assert link.wait_handed(60)  # in the log, past the position the dead bridge process left
    from otel_tracking.delivery.reader import pending_items
    print(json.dumps({"run_id": t.run_id, "spooled": pending_items(link.writer.logs["mlflow"].path)}), flush=True)
    time.sleep(600)
    """
)


def test_the_killed_attempts_spool_is_replayed_into_the_resumed_run(tmp_path: Path) -> None:
    """The killed job spooled steps 21..30 (its bridge process had died); the resumed job, with the
    same run id and so the same spool directory, spools into files of its own; replay afterwards
    puts the killed attempt's steps into the one MLflow run, which stays FINISHED."""
    env = {
        **os.environ,
        "OTEL_TRACKING_SPOOL_DIR": str(tmp_path / "spool"),
        "OTEL_TRACKING_START_TIMEOUT": "300",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    process = subprocess.Popen(
        [sys.executable, "-c", BRIDGE_LOST], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    report = _first_json_line(process)
    process.kill()
    process.wait()
    assert report["spooled"] == 10
    (spooled,) = (tmp_path / "spool").rglob("mlflow.jsonl")  # one spool file per sink (issue 36)
    client = readers_mlflow.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    left = readers_mlflow.only_run(client, client.get_experiment_by_name("proj").experiment_id)
    assert left.info.status == "RUNNING"  # nobody was left to end it

    resumed, _ = finish_after({**env, "OTEL_TRACKING_RESUME": "auto"}, tmp_path, 21, 40, ["mlflow"], 0.5)
    assert resumed["run_id"] == report["run_id"]
    assert spooled.exists()  # untouched by the second attempt

    done = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", str(tmp_path / "spool")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert not spooled.exists(), "delivered in full: removed"
    run = readers_mlflow.only_run(client, client.get_experiment_by_name("proj").experiment_id)
    assert run.info.status == "FINISHED" and run.data.tags["ml.run.attempt"] == "2"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert history == sorted(both_attempts(first_attempt_last=30, restart=20, last=40))


# --- in one process: the record, and what resume finds ----------------------------------------


def _file_env(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(root / "logs"))


def _lines(root: Path, experiment: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "logs" / "proj" / f"{experiment}.jsonl").read_text().splitlines()]


def test_resume_that_finds_nothing_starts_a_new_run_and_says_so(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _file_env(monkeypatch, isolated)
    monkeypatch.setenv("OTEL_TRACKING_RESUME", "auto")
    tracking = Tracking("proj", "exp", default_backend=["file"])
    tracking.log({"loss": 1.0}, 1)
    tracking.finish()
    err = capsys.readouterr().err
    assert f"resume=auto: no earlier run of proj/exp found; starting a new run {tracking.run_id}" in err
    assert _lines(isolated, "exp") == [{"step": 1, "data": {"loss": 1.0}}]  # no marker: a new run
    assert tracking._run is not None and tracking._run.resource.attributes["ml.run.attempt"] == 1

    # a run id that has no record: a new run with that id
    named = Tracking("proj", "other", default_backend=["file"], resume="my-run-7")
    named.finish()
    assert named.run_id == "my-run-7"
    assert "resume=my-run-7: no earlier run of proj/other found; starting a new run my-run-7" in capsys.readouterr().err


def test_resume_after_a_clean_finish_continues_the_same_run(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _file_env(monkeypatch, isolated)
    monkeypatch.setenv("TENSORBOARD_DIR", str(isolated / "tb"))
    monkeypatch.setenv("OTEL_TRACKING_START_TIMEOUT", "120")
    first = Tracking("proj", "exp", default_backend=["file", "tensorboard"])
    for step in range(1, 11):
        first.log({"loss": float(step)}, step)
    first.finish()

    second = Tracking("proj", "exp", default_backend=["file", "tensorboard"], resume="auto")
    assert "(the previous attempt was finished; what it logged from this attempt's first step on" in (
        capsys.readouterr().err
    )
    for step in range(11, 21):
        second.log({"loss": float(step)}, step)
    second.finish()

    assert second.run_id == first.run_id
    assert second._run is not None and second._run.resource.attributes["ml.run.attempt"] == 2
    lines = _lines(isolated, "exp")
    assert lines[10] == {"resumed_from_step": 10, "attempt": 2}
    assert read_metrics(isolated / "logs" / "proj" / "exp.jsonl")["loss"] == {s: float(s) for s in range(1, 21)}
    scalars, _, _ = read_events(isolated / "tb")
    assert scalars["loss"] == [(s, float(s)) for s in range(1, 21)]
    record = json.loads((isolated / "spool" / "proj" / f"exp-{first.run_id}" / "run.json").read_text())
    assert (record["attempt"], record["state"]) == (2, "finished")


def test_two_experiments_in_one_directory_do_not_pick_up_each_others_runs(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experiments "exp" and "exp-2" share a spool directory, and "exp-2-<run id>" starts like
    "exp-<run id>"; "my exp" and "my_exp" even share the directory name ("my_exp-<run id>")."""
    _file_env(monkeypatch, isolated)
    runs = {}
    experiments = ("exp", "exp-2", "my exp", "my_exp")
    for experiment in experiments:  # each one's record is newer than the one before
        tracking = Tracking("proj", experiment, default_backend=["file"])
        tracking.log({"loss": 1.0}, 1)
        tracking.finish()
        runs[experiment] = tracking.run_id
    for experiment in experiments:
        again = Tracking("proj", experiment, default_backend=["file"], resume="auto")
        again.finish()
        assert again.run_id == runs[experiment], experiment
    fresh = Tracking("proj", "ex", default_backend=["file"], resume="auto")
    fresh.finish()
    assert fresh.run_id not in runs.values()
    other_project = Tracking("proj2", "exp", default_backend=["file"], resume="auto")
    other_project.finish()
    assert other_project.run_id not in runs.values()


def test_a_resumed_attempt_spools_into_files_of_its_own(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_tracking.config.settings import build_settings
    from otel_tracking.delivery.pipeline import Sink
    from otel_tracking.delivery.spool import sink_spool

    _file_env(monkeypatch, isolated)
    Tracking("proj", "exp", default_backend=["file"]).finish()
    settings = build_settings("proj", "exp", (), resume="auto")
    assert settings.attempt == 2
    spool = sink_spool(Sink("mlflow"), settings, pid=1)
    assert spool is not None and spool.path.name == "mlflow.attempt2.jsonl" and spool.header["attempt"] == 2
    assert sink_spool(Sink("mlflow"), build_settings("proj", "exp", ()), pid=1).path.name == "mlflow.jsonl"


@pytest.mark.parametrize(
    ("variables", "match"),
    [
        ({"OTEL_TRACKING_RESUME": "not a run id!"}, "OTEL_TRACKING_RESUME"),
        ({"OTEL_TRACKING_RESUME": "run-a", "OTEL_TRACKING_RUN_ID": "run-b"}, "name different runs"),
    ],
)
def test_a_resume_value_that_cannot_be_used_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], match: str
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=match):
        Tracking("proj", "exp", default_backend=["file"])


def test_a_worker_joins_the_drivers_attempt() -> None:
    """Worker processes get the attempt from the driver's baggage (or the resource attributes that
    ``propagated_env`` hands them) and never look for records of their own."""
    from otel_tracking.distributed.environment import build_worker_settings, propagated_env

    assert build_worker_settings({"ml.run.id": "r-1", "ml.run.attempt": "3"}).attempt == 3
    env = propagated_env({"ml.run.id": "r-1", "ml.run.attempt": "2"}, env={"OTEL_TRACKING_RESUME": "auto"})
    settings = build_worker_settings({}, env=env)
    assert (settings.run_id, settings.attempt, settings.resumed) == ("r-1", 2, None)
    assert build_worker_settings({"ml.run.id": "r-1"}).attempt == 1


def test_a_tracker_opening_after_the_start_window_is_in_the_record_once_it_opens(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record is rewritten when a tracker opens in the background, not only at finish(): a job
    killed after that can be resumed into that tracker's run."""
    for variable, sub in (
        ("WANDB_DIR", ""),
        ("WANDB_CACHE_DIR", "c"),
        ("WANDB_DATA_DIR", "d"),
        ("WANDB_CONFIG_DIR", "f"),
    ):
        (isolated / "wandb" / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(variable, str(isolated / "wandb" / sub))
    monkeypatch.setenv("OTEL_TRACKING_START_TIMEOUT", "0")
    tracking = Tracking("proj", "exp", default_backend=["wandb"])
    try:
        assert tracking.where()["wandb"] == "opening in the otel-tracking bridge process"
        record = isolated / "spool" / "proj" / f"exp-{tracking.run_id}" / "run.json"
        assert json.loads(record.read_text())["backends"] == {}
        wait_for(lambda: tracking.where()["wandb"] != "opening in the otel-tracking bridge process", timeout_s=120)
        saved = json.loads(record.read_text())
        assert saved["state"] == "running" and saved["backends"]["wandb"]["id"]
    finally:
        tracking.finish()
