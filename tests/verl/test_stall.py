"""Who is stuck, where, and in which line (issue 32), on verl's own classes switched on from outside:
the verl-shaped loop (``run_loop.py``) with rank 1 of the actor group stuck in ``update_actor`` (a
``DistProfiler``-annotated method of a real ``RayWorkerGroup``) at step 3, and
``OTEL_TRACKING_STALL_AFTER=4``.  Read back from a real OTLP receiver while the rank is stuck."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.otlp_receiver import HttpReceiver, wait_for

HERE = Path(__file__).resolve().parent
BOUND_S = 4.0


def _start_loop(cluster: str, tmp: Path, receiver: HttpReceiver, **extra: str) -> subprocess.Popen[str]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_", "RAY_ADDRESS", "LOOP_"))}
    env.update(
        # this checkout's otel_tracking in the loop and its workers, not the verl venv's installed copy
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parents[1])]),
        VERL_FILE_LOGGER_PATH=str(tmp / "metrics.jsonl"),
        OTEL_TRACKING_SPOOL_DIR=str(tmp / "spool"),
        OTEL_TRACKING_VERL="1",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BLRP_SCHEDULE_DELAY="200",
        OTEL_TRACKING_STALL_AFTER=str(BOUND_S),
        **extra,
    )
    command = [sys.executable, str(HERE / "run_loop.py"), "--address", cluster, "--out", str(tmp / "result.json")]
    return subprocess.Popen(
        [*command, "--steps", "3"], env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _stalls(receiver: HttpReceiver) -> list[dict[str, Any]]:
    return [r for r in receiver.received.log_records() if r["event_name"] == "ml.stall"]


def test_a_healthy_run_under_the_same_bound_yields_no_stall(cluster: str, tmp_path: Path) -> None:
    with HttpReceiver() as receiver:
        healthy = _start_loop(cluster, tmp_path, receiver)
        _, err = healthy.communicate(timeout=600)
        assert healthy.returncode == 0, err[-4000:]
        stalls = [(r["attributes"]["ml.phase"], r["attributes"]["ml.stall.open_s"]) for r in _stalls(receiver)]
    assert stalls == [], f"a healthy run yields no ml.stall at all: {stalls}"


def test_a_phase_waiting_for_the_groups_actors_to_start_is_not_a_stall(cluster: str, tmp_path: Path) -> None:
    """The actor group's actors take long to start (their imports, a model's load: here until the
    test says so), and nothing called them before the loop: its first phases wait for them for
    several bounds.  The driver says it waits for the ranks to start, and sends no ml.stall."""
    flag = tmp_path / "actors-may-start"
    said: list[str] = []
    with HttpReceiver() as receiver:
        loop = _start_loop(cluster, tmp_path, receiver, LOOP_START_FLAG=str(flag))
        readers = [
            threading.Thread(target=lambda pipe=pipe: said.extend(iter(pipe.readline, "")), daemon=True)
            for pipe in (loop.stderr, loop.stdout)
        ]
        for reader in readers:
            reader.start()
        try:

            def notes(phase: str) -> list[str]:
                return [line for line in list(said) if f"phase '{phase}'" in line and "to start" in line]

            # said at 4 s, then again at 8 s: the phase has waited twice its bound
            try:
                wait_for(lambda: len(notes("gen")) >= 2 and notes("step"), timeout_s=180, what="the notes")
            except AssertionError as error:
                raise AssertionError(f"{error}; the loop said:\n{''.join(said)[-6000:]}") from None
            assert loop.poll() is None
        finally:
            flag.touch()
        loop.wait(timeout=600)
        for reader in readers:
            reader.join(timeout=60)
        assert loop.returncode == 0, "".join(said)[-4000:]
        stalls = [(r["attributes"]["ml.phase"], r["attributes"]["ml.stall.open_s"]) for r in _stalls(receiver)]
    assert stalls == [], f"waiting for ranks to start is not a stall: {stalls}"
    note = notes("gen")[0]
    assert "waiting for 2 rank(s) to start (0, 1); not a stall" in note, note
    assert not [line for line in said if "otel-tracking: stall:" in line], "no stall line either"


@pytest.mark.parametrize("busy", ["0", "1"], ids=["gil-releasing-wait", "pure-python-loop"])
def test_a_stuck_rank_is_named_with_its_line_by_itself_and_by_the_driver(
    cluster: str, tmp_path: Path, busy: str
) -> None:
    flag = tmp_path / "come-back"
    with HttpReceiver() as receiver:
        loop = _start_loop(
            cluster,
            tmp_path,
            receiver,
            LOOP_STALL_RANK="1",
            LOOP_STALL_CALL="3",
            LOOP_STALL_FLAG=str(flag),
            LOOP_STALL_BUSY=busy,
        )
        try:

            def both() -> tuple[dict[str, Any], dict[str, Any]] | None:
                records = _stalls(receiver)
                worker = [r for r in records if r["resource"].get("ml.rank") == 1 and r["resource"].get("ml.role")]
                driver = [r for r in records if r["attributes"].get("ml.phase") == "update_actor"]
                return (worker[0], driver[0]) if worker and driver else None

            worker, driver = wait_for(both, timeout_s=180, what="the stuck rank's and the driver's ml.stall records")
            assert loop.poll() is None and not flag.exists(), "reported while the rank is still stuck"
        finally:
            flag.touch()
        _, err = loop.communicate(timeout=600)
    assert loop.returncode == 0, err[-4000:]
    assert len(json.loads((tmp_path / "result.json").read_text())["results"]) == 3, "the run completed"

    # the stuck rank says it itself: its phase, step and the line it is stuck in
    assert worker["resource"]["ml.role"] == "actor"
    attributes = worker["attributes"]
    assert (attributes["ml.phase"], attributes["ml.step"]) == ("actor_update", 3), attributes
    assert BOUND_S <= attributes["ml.stall.open_s"] < BOUND_S + 15, attributes
    frame = attributes["ml.stall.frame"]
    assert "verl_loop_workers.py" in frame and "stuck_until_released" in frame, frame
    assert "stuck here" in worker["body"] and "in stuck_until_released" in worker["body"]

    # the driver (blocked in ray.get) names exactly that rank as the one it waits for, without asking it
    assert driver["attributes"]["ml.step"] == 3
    assert driver["attributes"]["ml.stall.waiting_ranks"] == [1], driver["attributes"]
    assert driver["attributes"]["ml.stall.done_ranks"] == [0], driver["attributes"]
    assert "rank 1: actor " in driver["body"] and ", pid " in driver["body"]
    assert "waiting for rank(s) 1" in err
