"""The library is a good citizen of the training process: the application's own SIGTERM handler
decides, and forked children (multiprocessing, Pools, DataLoader workers) neither end the parent
nor hold its files.  Each case is a real script in a child process, run several times."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

RUNS = 3  # each script several times: a race shows as a difference between runs


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER")}


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"step"' in line]


APP_HANDLER = textwrap.dedent(
    """
    import signal, sys, time
    from otel_tracking import Tracking

    stop = []

    def checkpoint_then_exit(signum, frame):
        stop.append(signum)  # the loop checkpoints, then exits: the app's own graceful shutdown

    if sys.argv[1] == "before":
        signal.signal(signal.SIGTERM, checkpoint_then_exit)
    t = Tracking("proj", "exp", default_backend="file")
    if sys.argv[1] == "after":
        signal.signal(signal.SIGTERM, checkpoint_then_exit)
    step = 0
    while not stop:
        t.log({"loss": 1.0 / (step + 1)}, step)
        print(f"logged {step}", flush=True)
        time.sleep(0.01)
        step += 1
    print("checkpointing", flush=True)
    time.sleep(4.5)  # longer than the library's 3 s grace for a main thread stuck in native code
    print("checkpoint written", flush=True)
    t.log({"loss": 0.0}, step)
    sys.exit(7)  # the app's own exit code
    """
)


@pytest.mark.parametrize("installed", ["after", "before"])
def test_the_apps_own_sigterm_handler_decides(tmp_path: Path, installed: str) -> None:
    """A graceful "checkpoint, then exit" handler, installed before or after ``Tracking()``: SIGTERM
    neither ends the process 3 s later mid-checkpoint nor changes its exit code, and every step it
    logged, the last one after the checkpoint included, is in the file."""
    for attempt in range(RUNS):
        cwd = tmp_path / str(attempt)
        cwd.mkdir()
        process = subprocess.Popen(
            [sys.executable, "-c", APP_HANDLER, installed], cwd=cwd, env=_env(), stdout=subprocess.PIPE, text=True
        )
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("logged 20"):
                break
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
        assert process.returncode == 7, rest
        assert "checkpoint written" in rest
        steps = _steps(cwd / "proj" / "exp.jsonl")
        assert steps == list(range(len(steps))) and len(steps) > 21


FORKS = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from otel_tracking import Tracking

    def helper():
        time.sleep(30)

    def square(x):
        return x * x

    fork = multiprocessing.get_context("fork")
    t = Tracking("proj", "exp", default_backend="file")
    for step in range(10):
        t.log({"loss": 1.0 / (step + 1)}, step)
        if step == 3:  # a helper process, terminated as a script stops its helpers
            p = fork.Process(target=helper)
            p.start()
            time.sleep(0.2)
            p.terminate()
            p.join()
            print("helper exit code", p.exitcode, flush=True)
            time.sleep(3.5)  # a watcher that acted on the child's SIGTERM would end this process now
        if step == 6:  # a reward-scoring pool: its exit terminates the workers
            with fork.Pool(2) as pool:
                print("pool", sum(pool.map(square, range(8))), flush=True)
            time.sleep(3.5)  # the same for the pool workers' SIGTERM
    t.finish()
    print("done", flush=True)
    """
)


def test_forked_children_terminated_leave_the_parent_and_its_files_alone(tmp_path: Path) -> None:
    """``Process.terminate()`` and ``with Pool(2)`` on fork children: the parent trains to the end,
    the helper dies of SIGTERM as it would without the library, and no child keeps the file sink's
    lock: the next run of the experiment writes the same file (the last one moved aside)."""
    for attempt in range(RUNS):
        done = subprocess.run(
            [sys.executable, "-c", FORKS], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"helper exit code {-signal.SIGTERM}" in done.stdout
        assert "pool 140" in done.stdout and "done" in done.stdout
        time.sleep(0.5)  # orphans, if any, are still alive now
        assert _steps(tmp_path / "proj" / "exp.jsonl") == list(range(10)), attempt  # not exp.<run id>.jsonl
        assert not list((tmp_path / "proj").glob("exp.*[0-9a-f].jsonl")), sorted((tmp_path / "proj").iterdir())
    assert len(list((tmp_path / "proj").glob("exp.2*.jsonl"))) == RUNS - 1  # the earlier runs, moved aside


ORPHAN = textwrap.dedent(
    """
    import os, sys, time
    from otel_tracking import Tracking

    t = Tracking("proj", "exp", default_backend="file")
    for step in range(3):
        t.log({"run": float(sys.argv[1])}, step)
    if os.fork() == 0:  # a helper that outlives the training process (an orphaned worker)
        time.sleep(8)
        os._exit(0)
    t.finish()
    """
)


def test_a_forked_child_that_outlives_the_run_does_not_hold_its_files(tmp_path: Path) -> None:
    """The next run of the experiment, started while an orphaned child of the last one still lives,
    writes the experiment's own file (the last run's moved aside), not a file tagged with its id."""
    for run in range(RUNS):
        log = tmp_path / f"run{run}.log"
        with log.open("w") as err:  # not a pipe: the orphan keeps its copy, and a pipe would wait for it
            done = subprocess.run(
                [sys.executable, "-c", ORPHAN, str(run)], cwd=tmp_path, env=_env(), stdout=err, stderr=err, timeout=60
            )
        assert done.returncode == 0, log.read_text()[-2000:]
        lines = [json.loads(line) for line in (tmp_path / "proj" / "exp.jsonl").read_text().splitlines()]
        assert [line["data"]["run"] for line in lines] == [float(run)] * 3
    assert len(list((tmp_path / "proj").glob("exp.*.jsonl"))) == RUNS - 1  # moved aside, none tagged with an id


@pytest.mark.backend
def test_project_and_experiment_names_never_climb_out_of_their_directory(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``experiment_name="../../../escaped/x"`` wrote outside the working directory (file and
    TensorBoard sinks); now every file is under it, ``/`` still nesting as the reference nests."""
    from otel_tracking import Tracking
    from tests.test_backend_tensorboard import read_events

    work = isolated / "deep" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    tracking = Tracking("../../proj", "../../../escaped/x", default_backend=["file", "tensorboard"])
    tracking.log({"loss": 0.5}, step=1)
    tracking.finish()
    written = [p for p in isolated.rglob("*") if p.is_file() and "spool" not in p.parts]
    assert written and all(work in p.parents for p in written), sorted(map(str, written))
    assert _steps(work / "__" / "__" / "proj" / "__" / "__" / "__" / "escaped" / "x.jsonl") == [1]
    scalars, _, _ = read_events(work / "tensorboard_log" / "__" / "__" / "proj" / "__" / "__" / "__" / "escaped" / "x")
    assert scalars["loss"] == [(1, 0.5)]


UMASK = textwrap.dedent(
    """
    import os
    os.umask(0o077)
    from otel_tracking import Tracking, trace_state
    t = Tracking("proj", "exp", default_backend="file")
    with trace_state("phase", step=1):
        t.log({"loss": 1.0}, 1)
    t.finish()
    """
)


def test_the_run_files_honour_the_umask(tmp_path: Path) -> None:
    """The events file holds prompts and model outputs: under ``umask 077`` nobody else may read
    it (it was forced to 0644)."""
    done = subprocess.run([sys.executable, "-c", UMASK], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for name in ("exp.jsonl", "exp.events.jsonl"):
        assert (tmp_path / "proj" / name).stat().st_mode & 0o777 == 0o600, name


THREAD_TRAINS = textwrap.dedent(
    """
    import threading, time
    from otel_tracking import Tracking

    t = Tracking("proj", "exp", default_backend=["file", "tensorboard"])

    def train():
        for step in range(20):
            t.log({"loss": 1.0 / (step + 1)}, step)
            time.sleep(0.05)
        print("trained", flush=True)

    threading.Thread(target=train).start()  # not a daemon: the interpreter waits for it
    print("main returns", flush=True)
    """
)


@pytest.mark.backend
def test_a_run_ends_when_the_interpreter_exits_not_when_the_main_thread_returns(tmp_path: Path) -> None:
    """The main thread returns while a non-daemon thread trains: the run was finished at once and
    19 of 20 steps were ignored in silence; now every step is in the file and in TensorBoard."""
    from tests.test_backend_tensorboard import read_events

    for attempt in range(RUNS):
        cwd = tmp_path / str(attempt)
        cwd.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", THREAD_TRAINS], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.splitlines()[-2:] == ["main returns", "trained"]
        assert _steps(cwd / "proj" / "exp.jsonl") == list(range(20))
        scalars, _, _ = read_events(cwd / "tensorboard_log" / "proj" / "exp")
        assert [step for step, _ in scalars["loss"]] == list(range(20))
        assert "not recorded" not in done.stderr


def test_a_log_after_the_run_finished_says_so_once(isolated: Path, caplog: pytest.LogCaptureFixture) -> None:
    from otel_tracking import Tracking

    tracking = Tracking("proj", "exp", default_backend=["file"])
    tracking.log({"loss": 1.0}, step=1)
    tracking.finish()
    tracking.log({"loss": 2.0}, step=2)
    tracking.log({"loss": 3.0}, step=3)
    said = [r.getMessage() for r in caplog.records if "after run" in r.getMessage()]
    assert len(said) == 1 and "log() at step 2 after run" in said[0] and "not recorded" in said[0]
    assert _steps(isolated / "proj" / "exp.jsonl") == [1]


SLOW_FINISH = textwrap.dedent(
    """
    from otel_tracking import Tracking, trace_state
    t = Tracking("proj", "exp", default_backend="file")
    for step in range(30):
        with trace_state("phase", step=step):
            t.log({"loss": 1.0 / (step + 1)}, step)
    print("finishing", flush=True)
    t.finish()
    print("finish returned", flush=True)
    """
)


def test_sigterm_during_finish_spools_what_is_left_prints_the_summary_and_exits_143(
    tmp_path: Path, isolated: Path
) -> None:
    """A scheduler's preemption while ``finish()`` drains an endpoint that takes nothing: the
    process ended at once with 143, nothing spooled, no summary; now what was queued is spooled,
    the summary says so, and the exit code is still 143."""
    import threading

    from tests.otlp_receiver import HttpReceiver
    from tests.servers import DelayProxy

    for attempt in range(RUNS):
        cwd = tmp_path / str(attempt)
        cwd.mkdir()
        with HttpReceiver() as receiver, DelayProxy(receiver.port, gate=threading.Event()) as hung:
            # the gate never opens: the endpoint takes nothing
            env = {
                **_env(),
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hung.port}",
                "OTEL_TRACKING_FINISH_TIMEOUT": "600",  # without the fix, finish() would wait this long
                "OTEL_TRACKING_SPOOL_DIR": str(cwd / "spool"),
            }
            process = subprocess.Popen(
                [sys.executable, "-c", SLOW_FINISH], cwd=cwd, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert process.stdout is not None
            for line in process.stdout:  # until the script says it is in finish()
                if line.strip() == "finishing":
                    break
            time.sleep(1.0)  # finish() is draining now
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=120)
        assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert "finish returned" not in out
        summary = re.finditer(r"otel-tracking: (otlp-\w+): \d+ items delivered, (\d+) spooled", err)
        spooled = {m.group(1): int(m.group(2)) for m in summary}
        assert spooled.get("otlp-traces", 0) > 0, err[-3000:]
        assert "otel-tracking replay" in err
        assert list((cwd / "spool").rglob("*.jsonl")) or list((cwd / "spool").rglob("*")), "nothing on disk"
        assert _steps(cwd / "proj" / "exp.jsonl") == list(range(30))
