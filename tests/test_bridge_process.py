"""The bridge process: the trackers run in a child of the training process (bridge_process.py).

What users rely on: the training process never imports a tracker's SDK, every value still arrives
(read back through MLflow and TensorBoard), a bridge that cannot start fails ``Tracking()`` as it
would in one process, and either process dying takes nothing that was handed over with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from otel_tracking import Tracking
from otel_tracking.config.settings import ConfigError
from tests import readers_mlflow as mlflow_reader
from tests.otlp_receiver import wait_for
from tests.servers import live_children, process_gone
from tests.test_backend_tensorboard import read_events

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _trackers_open_within_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tracking() returns once the trackers opened (a new sqlite store takes seconds): these tests
    # are about trackers that are open; the start window has tests of its own (test_start_window.py).
    monkeypatch.setenv("OTEL_TRACKING_START_TIMEOUT", "120")


def _mlflow_env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "OTEL_TRACKING_SPOOL_DIR": str(tmp_path / "spool"),
    }


def _run_of(tmp_path: Path, project: str) -> tuple[object, object]:
    client = mlflow_reader.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(project)
    return client, mlflow_reader.only_run(client, experiment.experiment_id)


def _replay(spool: Path, unset: tuple[str, ...] = ()) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", str(spool)],
        env={k: v for k, v in os.environ.items() if k not in unset},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr


def _loss(step: int) -> float:
    return 1.0 / (step + 1)


TRAINING = textwrap.dedent(
    """
    import json, os, sys
    from otel_tracking import Tracking, trace_state

    t = Tracking("proj", "exp", default_backend=["file", "mlflow", "tensorboard"], config={"lr": 0.1})
    for step in range(30):
        with trace_state("rollout", step=step):
            t.log({"train/loss": 1.0 / (step + 1), "train/step_sq": step * step}, step)
    child = t.logger["mlflow"].link.process.pid
    imported = sorted(m for m in ("mlflow", "tensorboard", "sqlalchemy", "wandb") if m in sys.modules)
    alive = os.path.exists(f"/proc/{child}")
    stats = t.finish()
    print(json.dumps({"imported": imported, "child": child, "me": os.getpid(), "alive": alive, "stats": stats}))
    """
)


def test_trackers_run_in_the_bridge_process_and_every_value_arrives(tmp_path: Path) -> None:
    env = {**_mlflow_env(tmp_path), "TENSORBOARD_DIR": str(tmp_path / "tb")}
    done = subprocess.run(
        [sys.executable, "-c", TRAINING], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["imported"] == []  # not one tracker SDK in the training process
    assert report["alive"] and report["child"] != report["me"]
    # 30 steps, 30 phase spans and the 30 steps' root spans each: nothing lost on the way
    for backend in ("mlflow", "tensorboard"):
        assert report["stats"][backend] == {"delivered": 90, "failed": 0, "retried": 0, "spooled": 0, "dropped": 0}

    client, run = _run_of(tmp_path, "proj")
    expected = sorted(
        [("train/loss", s, _loss(s)) for s in range(30)] + [("train/step_sq", s, s * s) for s in range(30)]
    )
    triples = mlflow_reader.metric_triples(client, run.info.run_id)
    assert [t for t in triples if not t[0].startswith("timing_s/")] == expected
    assert [t[1] for t in triples if t[0] == "timing_s/state/rollout"] == list(range(30))  # from the spans
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    # MLflow names the training script as the source, not the bridge process's module
    assert run.data.tags["mlflow.source.name"] == "-c"
    spans = mlflow_reader.traces(client, run.info.experiment_id, run.info.run_id)
    assert len(spans) == 30

    scalars, _, _ = read_events(tmp_path / "tb")
    assert scalars["train/loss"] == [(s, pytest.approx(_loss(s))) for s in range(30)]


KILLED = textwrap.dedent(
    """
    import os, sys, time
    from otel_tracking import Tracking

    t = Tracking("proj", "exp", default_backend=["file", "mlflow"])
    for step in range(20):
        t.log({"loss": 1.0 / (step + 1)}, step)
    assert t.logger["mlflow"].link.wait_handed(60)  # every step handed to the pipe
    print("child", t.logger["mlflow"].link.process.pid, flush=True)
    time.sleep(600)
    """
)


def test_training_process_killed_the_bridges_still_deliver_and_end_the_run(tmp_path: Path) -> None:
    """SIGKILL gives the training process no chance to finish: the bridge process sees its pipe
    close, delivers everything it was handed and ends the MLflow run as failed."""
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED], cwd=tmp_path, env=_mlflow_env(tmp_path), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    child = int(next(line for line in process.stdout if line.startswith("child ")).split()[1])
    process.kill()  # the script printed the pid once every step was handed over
    process.wait()
    wait_for(lambda: process_gone(child), timeout_s=120, what="the bridge process to finish on its own")

    client, run = _run_of(tmp_path, "proj")
    assert run.info.status == "FAILED"
    assert mlflow_reader.metric_triples(client, run.info.run_id) == [("loss", s, _loss(s)) for s in range(20)]


def test_bridge_process_killed_training_goes_on_and_replay_delivers_the_rest(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{isolated / 'mlflow.db'}")
    tracking = Tracking("proj", "exp", default_backend=["file", "mlflow"])
    for step in range(10):
        tracking.log({"loss": _loss(step)}, step)
    assert tracking.flush(timeout_s=120)
    child = tracking.logger["mlflow"].link.process
    child.kill()
    child.wait()
    for step in range(10, 20):
        tracking.log({"loss": _loss(step)}, step)  # never blocks, never raises
    started = time.monotonic()
    stats = tracking.finish()
    assert time.monotonic() - started < 10
    # counted as the child acknowledged them, not from its final reply, which died with it (issue 19,
    # item 8: this said "delivered 0" before)
    assert stats["mlflow"]["delivered"] == 10
    assert stats["mlflow"]["spooled"] == 10
    assert any("the bridge process is gone" in r.getMessage() for r in caplog.records)
    # One spool file per sink, whichever process wrote to it (issue 36)
    assert [p.name for p in (isolated / "spool").rglob("mlflow*.jsonl")] == ["mlflow.jsonl"]

    # No MLFLOW_TRACKING_URI: replay goes to the URI the run used (kept in the spool header).
    _replay(isolated / "spool", unset=("MLFLOW_TRACKING_URI",))
    client, run = _run_of(isolated, "proj")  # the same run: replay reattached to it
    assert mlflow_reader.metric_triples(client, run.info.run_id) == [("loss", s, _loss(s)) for s in range(20)]
    # Nobody was left to end the run when training finished; the spool's end record did, at replay.
    assert run.info.status == "FINISHED"


def test_bridge_process_killed_with_a_backlog_loses_nothing(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records the child had not delivered when it died wait in the tracker's log, past its
    position; finish() counts them spooled, and replay delivers every (key, step, value) exactly
    once (MLflow ignores an exact duplicate of a point, should the record on its way have landed)."""
    from otel_tracking.delivery.reader import pending_items

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{isolated / 'mlflow.db'}")
    keys = [f"k{i}" for i in range(50)]
    tracking = Tracking("proj", "exp", default_backend=["mlflow"])
    for step in range(300):
        tracking.log({key: step + i / 100 for i, key in enumerate(keys)}, step)
    link = tracking.logger["mlflow"].link
    assert link.wait_handed(60)  # every step is in the log
    link.process.send_signal(signal.SIGSTOP)  # (so that the backlog counted is the one it dies with)
    backlog = pending_items(link.writer.logs["mlflow"].path)
    assert backlog > 0  # MLflow takes tens of ms a step: the child has a backlog now
    link.process.kill()
    link.process.wait()
    for step in range(300, 310):
        tracking.log({key: step + i / 100 for i, key in enumerate(keys)}, step)
    stats = tracking.finish()
    assert stats["mlflow"]["spooled"] >= backlog + 10, (backlog, stats)
    assert stats["mlflow"]["delivered"] + stats["mlflow"]["spooled"] == 310, stats

    _replay(isolated / "spool")
    client, run = _run_of(isolated, "proj")
    expected = sorted((key, step, step + i / 100) for step in range(310) for i, key in enumerate(keys))
    assert mlflow_reader.metric_triples(client, run.info.run_id) == expected


def test_a_bridge_that_cannot_start_fails_tracking_and_leaves_no_process(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = isolated / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("TENSORBOARD_DIR", str(blocker / "tb"))
    before = live_children()
    with pytest.raises(ConfigError, match="backend 'tensorboard' cannot write where it should"):
        Tracking("proj", "exp", default_backend=["file", "tensorboard"])
    wait_for(lambda: live_children() <= before, timeout_s=30, what="the bridge process to exit")

    # the same error as with the bridges in this process
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", "false")
    with pytest.raises(ConfigError, match="backend 'tensorboard' cannot write where it should"):
        Tracking("proj", "exp", default_backend=["file", "tensorboard"])


def test_sigterm_finishes_the_bridges_with_the_exit_code(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import time
        from otel_tracking import Tracking

        t = Tracking("proj", "exp", default_backend=["file", "mlflow"])
        for step in range(15):
            t.log({"loss": 1.0 / (step + 1)}, step)
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=tmp_path, env=_mlflow_env(tmp_path), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert any(line.strip() == "ready" for line in process.stdout)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 128 + signal.SIGTERM
    client, run = _run_of(tmp_path, "proj")
    assert run.info.status == "FAILED"
    assert mlflow_reader.metric_triples(client, run.info.run_id) == [("loss", s, _loss(s)) for s in range(15)]


FULL_LINK = textwrap.dedent(
    """
    import json, os, signal
    from otel_tracking import Tracking

    t = Tracking("proj", "full", default_backend=["mlflow", "tensorboard"])
    link = t.logger["mlflow"].link
    os.kill(link.process.pid, signal.SIGSTOP)  # the child delivers nothing any more
    for step in range(60):
        t.log({f"m{i}": step + i / 1000 for i in range(200)}, step)
    assert link.wait_handed(60)
    logs = {name: log.path.read_bytes().splitlines()[1:] for name, log in link.writer.logs.items()}
    assert logs["mlflow"] == logs["tensorboard"] and len(logs["mlflow"]) == 60  # the same record in each
    os.kill(link.process.pid, signal.SIGKILL)
    print(json.dumps(t.finish()))
    """
)


def test_a_log_call_is_kept_for_every_tracker_it_was_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One log() call is encoded once and appended to the log of each tracker it is for; with
    the child stopped, then killed, every call is spooled for each of them (once, it was spooled
    for the first one only) and replay delivers it to both."""
    env = {**_mlflow_env(tmp_path), "TENSORBOARD_DIR": str(tmp_path / "tb"), "OTEL_TRACKING_QUEUE_SIZE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", FULL_LINK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["mlflow"]["spooled"] == 60 and stats["tensorboard"]["spooled"] == 60, stats
    for name in ("mlflow", "tensorboard"):  # every call accounted for, for each bridge
        assert stats[name]["delivered"] + stats[name]["spooled"] == 60 and stats[name]["dropped"] == 0, stats
    for key in ("MLFLOW_TRACKING_URI", "TENSORBOARD_DIR"):
        monkeypatch.setenv(key, env[key])  # replay writes where the run did
    _replay(tmp_path / "spool")
    client, run = _run_of(tmp_path, "proj")
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "m7")) == list(range(60))
    scalars, _, _ = read_events(tmp_path / "tb")
    assert sorted(step for step, _ in scalars["m7"]) == list(range(60))


def test_a_failure_after_the_bridges_started_leaves_no_process(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything that fails in Tracking() after the bridge process started (here the run's own
    construction, an injected fault) takes the bridge process down with it."""
    from otel_tracking.runtime import assembly

    def broken_run(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setenv("TENSORBOARD_DIR", str(isolated / "tb"))
    monkeypatch.setattr(assembly, "Run", broken_run)
    before = live_children()
    with pytest.raises(RuntimeError, match="injected"):
        Tracking("proj", "exp", default_backend=["file", "tensorboard"])
    wait_for(lambda: live_children() <= before, timeout_s=30, what="the bridge process to exit")


HUNG_CHILD = textwrap.dedent(
    """
    import json, os, signal
    from otel_tracking import Tracking

    t = Tracking("proj", "hung", default_backend=["mlflow", "tensorboard"])
    child = t.logger["mlflow"].link.process.pid
    print("child", child, flush=True)
    os.kill(child, signal.SIGSTOP)  # hung: it reads nothing, answers nothing
    for step in range(60):
        t.log({f"m{i}": step + i / 1000 for i in range(200)}, step)
    print(json.dumps(t.finish()), flush=True)
    """
)


def test_finish_returns_in_bounded_time_when_the_bridge_process_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link stuck writing to a child that reads nothing, its queue full: finish() neither
    blocks on the queue nor on the pipe; it spools what the child did not take, stops the child,
    and replay delivers every step."""
    env = {
        **_mlflow_env(tmp_path),
        "TENSORBOARD_DIR": str(tmp_path / "tb"),
        "OTEL_TRACKING_QUEUE_SIZE": "1",
        "OTEL_TRACKING_FINISH_TIMEOUT": "1",
    }
    done = subprocess.run(  # a hang fails at the cap
        [sys.executable, "-c", HUNG_CHILD], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    child = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("child "))
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("mlflow", "tensorboard"):
        assert stats[name]["spooled"] == 60 and stats[name]["dropped"] == 0, stats
    wait_for(lambda: process_gone(child), timeout_s=30, what="the hung bridge process stopped")
    for key in ("MLFLOW_TRACKING_URI", "TENSORBOARD_DIR"):
        monkeypatch.setenv(key, env[key])
    _replay(tmp_path / "spool")
    client, run = _run_of(tmp_path, "proj")
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "m7")) == list(range(60))
    scalars, _, _ = read_events(tmp_path / "tb")
    assert sorted(step for step, _ in scalars["m7"]) == list(range(60))


def test_a_request_into_a_full_pipe_to_a_child_that_stopped_reading_is_bounded(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19, item 12: the pipe to a child that stopped reading is full (here filled from
    outside), and no other writer holds it: flush() and finish() still return (a write is bounded
    by its deadline, not only the wait for the pipe), the child is stopped, and nothing is lost."""
    import threading

    monkeypatch.setenv("TENSORBOARD_DIR", str(isolated / "tb"))
    monkeypatch.setenv("OTEL_TRACKING_FINISH_TIMEOUT", "1")
    tracking = Tracking("proj", "exp", default_backend=["tensorboard"])
    for step in range(5):
        tracking.log({"loss": _loss(step)}, step)
    assert tracking.flush(timeout_s=120)
    link = tracking.logger["tensorboard"].link
    link.process.send_signal(signal.SIGSTOP)  # it reads nothing any more
    try:
        fd = link._to_child_w
        blocking = os.get_blocking(fd)
        os.set_blocking(fd, False)
        with pytest.raises(BlockingIOError):
            while True:
                os.write(fd, bytes(4096))
        os.set_blocking(fd, blocking)  # as the link left it

        def within(cap_s: float, call: Callable[[], T]) -> T:
            result: list[T] = []
            thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
            thread.start()
            thread.join(cap_s)
            assert result, f"blocked for {cap_s} s writing to the full pipe"
            return result[0]

        assert within(120, lambda: tracking.flush(timeout_s=1)) is False
        stats = within(120, tracking.finish)
    finally:
        with contextlib.suppress(ProcessLookupError):
            link.process.send_signal(signal.SIGKILL)
    assert stats["tensorboard"]["delivered"] == 5 and stats["tensorboard"]["dropped"] == 0, stats
    wait_for(lambda: link.process.poll() is not None, timeout_s=60, what="the stuck bridge process stopped")
    scalars, _, _ = read_events(isolated / "tb")
    assert scalars["loss"] == [(s, pytest.approx(_loss(s))) for s in range(5)]


def test_a_tracker_taking_something_never_waits_on_a_full_pipe() -> None:
    """In the bridge process, a reader says its tracker took something (the Progress that
    finish() waits on) from its own thread: that must not wait while the pipe to a training
    process that reads nothing is full (a frozen or busy parent); the Progress follows once the
    pipe has room."""
    import multiprocessing
    import pickle
    import threading

    from otel_tracking.bridges.child import _Outbox
    from otel_tracking.bridges.wire import Progress

    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = _Outbox(writer)
    outbox.start()
    big = threading.Thread(target=outbox.send, args=(b"x" * (4 << 20),), daemon=True)
    big.start()  # blocks: nobody reads the pipe yet
    assert reader.poll(10)
    assert big.is_alive()
    said = threading.Thread(target=outbox.progressed, daemon=True)
    said.start()
    said.join(2.0)
    assert not said.is_alive(), "saying progress waited on the pipe"
    messages = [pickle.loads(reader.recv_bytes())]
    big.join(5.0)
    messages.append(pickle.loads(reader.recv_bytes()))
    assert messages == [b"x" * (4 << 20), Progress()]
