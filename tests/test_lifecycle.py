"""Process lifecycle: SIGTERM, SIGKILL, fork, and many threads logging at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_tracking import Tracking, trace_state
from tests import readers_mlflow as mlflow_reader
from tests.otlp_receiver import HttpReceiver, wait_for
from tests.servers import DelayProxy, MlflowServer


def child_env(receiver: HttpReceiver | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER")}
    if receiver is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
    return env


def file_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


LOOP = textwrap.dedent(
    """
    import sys, time
    from otel_tracking import Tracking, trace_state

    t = Tracking("proj", "exp", default_backend="file")
    step = 0
    while True:
        with trace_state("phase", step=step):
            t.log({"loss": 1.0 / (step + 1)}, step)
            print(f"logged {step}", flush=True)
            time.sleep(0.01)
        step += 1
    """
)


def run_until(tmp_path: Path, env: dict[str, str], steps: int) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen([sys.executable, "-c", LOOP], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    last = -1
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("logged "):
            last = int(line.split()[1])
            if last >= steps:
                break
    return process, last


def test_sigterm_finishes_the_run_cleanly(tmp_path: Path) -> None:
    with HttpReceiver() as receiver:
        process, last = run_until(tmp_path, child_env(receiver), 20)
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
        assert process.returncode == 128 + signal.SIGTERM
        printed = last + sum(1 for line in rest.splitlines() if line.startswith("logged "))
        steps = file_steps(tmp_path / "proj" / "exp.jsonl")
        assert steps == list(range(len(steps))) and len(steps) >= printed
        # finish() ran: the final gauges and every ended span reached the collector.
        assert wait_for(receiver.received.last_gauges, what="gauges")["train.step"] == steps[-1]
        spans = wait_for(lambda: len(receiver.received.spans()) >= len(steps) and receiver.received.spans())
        interrupted = [s for s in spans if s["attributes"]["ml.step"] == steps[-1] and s["name"] == "phase"]
        assert len(interrupted) == 1, "the span open at SIGTERM was ended, once"
    events = [json.loads(line) for line in (tmp_path / "proj" / "exp.events.jsonl").read_text().splitlines()]
    assert len(events) == len(spans)


def test_after_sigkill_the_file_holds_every_step_log_returned(tmp_path: Path) -> None:
    process, last = run_until(tmp_path, child_env(), 50)
    process.kill()
    process.wait(timeout=30)
    steps = file_steps(tmp_path / "proj" / "exp.jsonl")
    assert steps[: last + 1] == list(range(last + 1)), "every step whose log() returned is on disk"


FORK = textwrap.dedent(
    """
    import os, sys
    from otel_tracking import Tracking, trace_state

    t = Tracking("proj", "exp", default_backend="file")
    for step in range(5):
        with trace_state("parent", step=step):
            t.log({"x": step}, step)
    pid = os.fork()
    if pid == 0:
        with trace_state("child", step=100):
            t.log({"x": 100}, 100)
        sys.exit(0)  # a normal exit: exit hooks run in the child too
    os.waitpid(pid, 0)
    for step in range(5, 10):
        with trace_state("parent", step=step):
            t.log({"x": step}, step)
    t.finish()
    """
)


def test_a_forked_child_does_not_re_export_the_parents_run(tmp_path: Path) -> None:
    """The child's log() on the inherited Tracking is ignored; its spans are its own (a worker run
    of the same run id, from the child's pid), as in any process without a Tracking."""
    with HttpReceiver() as receiver:
        out = subprocess.run(
            [sys.executable, "-c", FORK],
            cwd=tmp_path,
            env=child_env(receiver),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "inherited through fork() is ignored" in out.stderr
        assert file_steps(tmp_path / "proj" / "exp.jsonl") == list(range(10))

        def phases() -> list[dict]:
            return [s for s in receiver.received.spans() if s["name"] != "ml.step"]

        spans = wait_for(lambda: len(phases()) >= 11 and phases())
        parent = [s for s in spans if s["name"] == "parent"]
        assert sorted(s["attributes"]["ml.step"] for s in parent) == list(range(10))
        (child,) = [s for s in spans if s["name"] == "child"]
        assert child["attributes"]["ml.step"] == 100
        assert child["resource"]["process.pid"] != parent[0]["resource"]["process.pid"]
        assert child["resource"]["ml.run.id"] == parent[0]["resource"]["ml.run.id"]
        steps_seen = [value for _, name, _, value, _ in receiver.received.gauge_points() if name == "train.step"]
        assert 100 not in steps_seen and steps_seen[-1] == 9


def test_eight_threads_logging_at_once_lose_nothing(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("proj", "exp", default_backend=["file", "console"])
        barrier = threading.Barrier(8)

        def worker(lane: int) -> None:
            barrier.wait()
            for i in range(200):
                with trace_state("work", state_lane_id=lane):
                    tracking.log({f"lane{lane}/value": lane * 1000 + i}, step=lane * 1000 + i)

        threads = [threading.Thread(target=worker, args=(lane,)) for lane in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = tracking.finish()
        lines = [json.loads(line) for line in (isolated / "proj" / "exp.jsonl").read_text().splitlines()]
        assert sorted(line["step"] for line in lines) == sorted(
            lane * 1000 + i for lane in range(8) for i in range(200)
        )
        for line in lines:
            ((key, value),) = line["data"].items()
            assert value == line["step"] and key == f"lane{line['step'] // 1000}/value"
        spans = receiver.received.spans()
        assert stats["otlp-traces"]["delivered"] == len(spans)  # the phases and their steps' root spans
        work = [s for s in spans if s["name"] == "work"]
        assert len(work) == 1600 and len({s["span_id"] for s in work}) == 1600
        gauges = receiver.received.last_gauges()
        for lane in range(8):
            assert gauges[f"lane{lane}/value"] == lane * 1000 + 199


BLOCKED = textwrap.dedent(
    """
    import ctypes, sys
    from otel_tracking import Tracking

    native = ctypes.CDLL(sys.argv[1])
    t = Tracking("proj", "exp", default_backend="file")
    t.logger["file"]._on_finish = lambda code: print(f"run finished with {code}", flush=True)
    for step in range(3):
        t.log({"loss": 1.0 / (step + 1)}, step)
    print("blocking", flush=True)
    native.block_forever()  # a hung collective: native code that never returns, not even on EINTR
    """
)


def test_sigterm_ends_a_process_blocked_in_native_code(tmp_path: Path) -> None:
    """Without the library, SIGTERM kills a process stuck in native code at once; with a Tracking
    open it must still end within a few seconds (not when the native call returns), data safe."""
    source = tmp_path / "block.c"
    source.write_text("#include <unistd.h>\nvoid block_forever(void) { for (;;) sleep(1); }\n")
    library = tmp_path / "libblock.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60)
    process = subprocess.Popen(
        [sys.executable, "-c", BLOCKED, str(library)], cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert "blocking" in iter(lambda: process.stdout.readline().strip(), "")  # waits for the line
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)  # a generous cap: without the watcher it would never return
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("SIGTERM did not end a process blocked in native code") from None
    assert process.returncode == 128 + signal.SIGTERM
    assert "run finished with 143" in process.stdout.read()  # finished (briefly) before the exit
    assert file_steps(tmp_path / "proj" / "exp.jsonl") == [0, 1, 2]


INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, time
    from otel_tracking import Tracking

    # Ctrl-C as in a terminal: a test run started in the background by a non-interactive shell
    # inherits SIGINT ignored, and Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def train(t):
        for step in range(5):
            t.log({"loss": 1.0 / (step + 1)}, step)
        print("run id", t.run_id, flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        # Training goes on until Python raises KeyboardInterrupt in the main thread (the signal
        # may land on another thread, and then signal.pause() would not return).
        while True:
            time.sleep(0.05)

    backends = ["file", "mlflow", "wandb"]
    if sys.argv[1] == "with":
        with Tracking("proj", "exp", default_backend=backends) as t:
            train(t)
    else:
        train(Tracking("proj", "exp", default_backend=backends))
    """
)


@pytest.mark.parametrize("shape", ["with", "plain"])
def test_ctrl_c_is_recorded_as_an_interrupted_run_in_every_tracker(tmp_path: Path, shape: str) -> None:
    """After SIGINT, run.json said exit_code 0 and MLflow FINISHED (issue 19, item 13): now 130,
    MLflow FAILED and wandb's exit code 130, whether a ``with`` block or the exit hook finishes."""
    from tests import readers_mlflow, readers_wandb

    env = {
        **child_env(),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "WANDB_DIR": str(tmp_path),
        "OTEL_TRACKING_START_TIMEOUT": "120",
    }
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, shape], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == -signal.SIGINT, done.stderr  # Python ends itself with SIGINT: 130 in a shell
    assert "KeyboardInterrupt" in done.stderr
    run_id = done.stdout.split("run id ")[1].split()[0]
    (record,) = (tmp_path / "spool").rglob("run.json")
    state = json.loads(record.read_text())
    assert (state["run_id"], state["state"], state["exit_code"]) == (run_id, "finished", 130)
    assert file_steps(tmp_path / "proj" / "exp.jsonl") == [0, 1, 2, 3, 4]
    client = readers_mlflow.client(env["MLFLOW_TRACKING_URI"])
    run = readers_mlflow.only_run(client, client.get_experiment_by_name("proj").experiment_id)
    assert run.info.status in ("FAILED", "KILLED")
    assert [s for _, s, _ in readers_mlflow.metric_triples(client, run.info.run_id)] == [0, 1, 2, 3, 4]
    assert readers_wandb.only_run(tmp_path).exit_code == 130


def test_the_exit_code_a_run_is_ended_with(isolated: Path) -> None:
    from otel_tracking.runtime.lifecycle import exit_code_for

    assert [exit_code_for(e) for e in (None, KeyboardInterrupt(), SystemExit(143), SystemExit(), ValueError())] == [
        0,
        130,
        143,
        0,
        1,
    ]
    assert exit_code_for(SystemExit("bye")) == 1
    for error, code in ((ValueError("x"), 1), (SystemExit(3), 3), (KeyboardInterrupt(), 130)):
        with pytest.raises(type(error)), Tracking("proj", "exp", default_backend=[]) as tracking:
            raise error
        record = isolated / "spool" / "proj" / f"exp-{tracking.run_id}" / "run.json"
        assert json.loads(record.read_text())["exit_code"] == code


# --- finish() and a slow backend ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()


@pytest.mark.parametrize("bridge_process", ["true", "false"])  # the child's finish, and this process's
def test_finish_waits_for_a_slow_backend_for_as_long_as_it_keeps_delivering(
    bridge_process: str,
    mlflow_server: MlflowServer,
    isolated: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Issue 19, item 4: MLflow takes at least 1 s a request (a proxy holds each chunk), so its 200
    steps of 200 metrics (queued steps leave together, issue 22: 40 requests of 1,000 metrics,
    four at once, each 2 or 3 chunks, one group of about 40,000 points) need longer than the 10 s
    finish timeout and the 10 s the training process gives the bridge process beyond it (about
    30 s); it never stops making progress (four requests land together every 2 to 3 s, though the
    group's steps are settled only when all of it landed), so finish() delivers every step
    (nothing spooled), saying what it waits for, and the run is complete."""
    steps = 200
    keys = [f"actor/metric_{i}" for i in range(200)]
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", bridge_process)
    # The bound for a backend that delivers nothing: rounds of requests land up to 3 s apart here,
    # more on a busy machine (a 5 s bound once spooled the group in CI); the group takes over 20 s.
    monkeypatch.setenv("OTEL_TRACKING_FINISH_TIMEOUT", "10")
    monkeypatch.setenv("OTEL_TRACKING_START_TIMEOUT", "300")  # MLflow opens (slowly) before log()
    project = f"slow-{bridge_process}"
    with DelayProxy(mlflow_server.port, delay_s=1.0) as proxy:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{proxy.port}")
        tracking = Tracking(project, "run", default_backend=["mlflow"])
        for step in range(steps):
            tracking.log({key: step + i / 1000 for i, key in enumerate(keys)}, step)
        stats = tracking.finish()
    assert stats["mlflow"] == {"delivered": steps, "failed": 0, "retried": 0, "spooled": 0, "dropped": 0}
    assert not list((isolated / "spool").rglob("*.jsonl"))
    said = [r.getMessage() for r in caplog.records] + capfd.readouterr().err.splitlines()
    assert any("still delivering to mlflow" in line for line in said), said  # the progress line

    client = mlflow_reader.client(mlflow_server.uri)
    run = mlflow_reader.only_run(client, client.get_experiment_by_name(project).experiment_id)
    expected = sorted((key, s, s + i / 1000) for s in range(steps) for i, key in enumerate(keys))
    assert mlflow_reader.metric_triples(client, run.info.run_id) == expected
    assert run.info.status == "FINISHED"
