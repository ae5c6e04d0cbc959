"""`otel-tracking replay` stopped and started again (issue 31, item 8): Ctrl-C, SIGTERM or SIGKILL at
any moment, any number of times, and every spooled record arrives at most once; none is lost
without being named (a record a killed replay had on its way is set aside in ``*.in-doubt``).

Before, an interrupted replay left the file as it was and the next one delivered it all again
(3,000 spooled steps, Ctrl-C, replay again: TensorBoard held 3,502 points)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_tracking.delivery.spool import Damaged, Spool, read_spool
from tests.otlp_receiver import HttpReceiver
from tests.test_replay import _spool

_SIGNALS = {"int": signal.SIGINT, "term": signal.SIGTERM, "kill": signal.SIGKILL}


def _spans_spool(path: Path, n: int) -> None:
    """A spool of ``n`` records, one span each, named ``r1-0`` .. ``r1-<n-1>``."""
    _spool(path, "r1", n).close()


def _replay_to_the_end(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _start_replay(path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "otel_tracking", "replay", str(path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _names(receiver: HttpReceiver) -> list[str]:
    return [span["name"] for span in receiver.received.spans()]


def _in_doubt(path: Path) -> list[str]:
    """The span names of the records set aside beside ``path``."""
    doubt = path.with_name(path.name + ".in-doubt")
    if not doubt.exists():
        return []
    header, records = read_spool(doubt)
    assert header["sink"] == "otlp-traces", "a spool log of its own: replay it by name to deliver it anyway"
    names = []
    for record in records:
        assert not isinstance(record, Damaged), f"a damaged record in {doubt}: {record}"
        names += [span.name for span in record[1]]
    return names


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    stops=st.lists(
        st.tuples(st.sampled_from(sorted(_SIGNALS)), st.integers(min_value=1, max_value=25)), min_size=1, max_size=3
    )
)
def test_every_spooled_record_arrives_at_most_once_however_replay_is_stopped(
    stops: list[tuple[str, int]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Model: replay is stopped by each (signal, after k more records arrived) in turn, then runs to
    the end.  Invariant: no record arrives twice; every record arrived or is in the in-doubt file
    (and only a SIGKILL puts one there); Ctrl-C and SIGTERM end replay with 130 and say so."""
    root = tmp_path_factory.mktemp("replay")
    path = root / "spool" / "p" / "e-r1" / "otlp-traces.jsonl"
    n = 80
    _spans_spool(path, n)
    with HttpReceiver() as receiver:
        receiver.received.answer_after_s = 0.02  # a slow collector: a SIGKILL lands inside a request
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACKING_SPOOL_DIR": str(root)}
        for name, k in stops:
            if not path.exists():
                break
            target = len(_names(receiver)) + k
            replay = _start_replay(path, env)
            deadline = time.monotonic() + 60
            while len(_names(receiver)) < target and replay.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            replay.send_signal(_SIGNALS[name])
            _, err = replay.communicate(timeout=60)
            if replay.returncode in (0, 75):  # it had finished before the signal came
                continue
            if name == "kill":
                assert replay.returncode == -signal.SIGKILL
            else:
                assert replay.returncode == 130, err
                assert "interrupted; run it again to go on" in err, err
        if path.exists():
            final = _replay_to_the_end(path, env)
            assert final.returncode in (0, 75), final.stderr
        arrived = _names(receiver)
    doubt = _in_doubt(path)
    twice = sorted({name for name in arrived if arrived.count(name) > 1})
    assert not twice, f"delivered twice: {twice}"
    assert set(arrived) | set(doubt) == {f"r1-{i}" for i in range(n)}, "a record neither arrived nor was set aside"
    if "kill" not in [name for name, _ in stops]:
        assert doubt == [], "only a replay killed with a record on its way sets one aside"
    assert not path.exists(), "the last replay delivered the rest and removed the log"
    assert not path.with_name(path.name + ".pos").exists()


def test_a_replay_interrupted_by_ctrl_c_goes_on_and_tensorboard_holds_each_step_once(tmp_path: Path) -> None:
    """The issue's case: 3,000 spooled TensorBoard steps, Ctrl-C during replay, replay again."""
    from opentelemetry.sdk.resources import Resource
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from otel_tracking.signals.steps import StepBatch

    tb = tmp_path / "tb"
    path = tmp_path / "spool" / "p" / "e-r1" / "tensorboard.jsonl"
    header = {"sink": "tensorboard", "project": "p", "experiment": "e", "run_id": "r1", "pid": 1}
    spool = Spool(path, {**header, "destination": {"TENSORBOARD_DIR": str(tb)}})
    resource = Resource.create({})
    for step in range(3000):
        spool.write("metrics", StepBatch(resource, step, {"loss": step / 10}, {}, time.time_ns()))
    spool.close()
    env = {**os.environ, "OTEL_TRACKING_SPOOL_DIR": str(tmp_path / "spool")}

    replay = _start_replay(path, env)
    position = path.with_name(path.name + ".pos")
    deadline = time.monotonic() + 60
    while replay.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            if json.loads(position.read_text())["offset"] > path.stat().st_size // 6:
                break
        time.sleep(0.005)
    replay.send_signal(signal.SIGINT)
    _, err = replay.communicate(timeout=60)
    assert replay.returncode == 130, err
    assert "interrupted; the next replay goes on after record" in err, err

    again = _replay_to_the_end(path, env)
    assert again.returncode == 0, again.stderr
    assert "going on after record" in again.stderr

    accumulator = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    accumulator.Reload()
    steps = [event.step for event in accumulator.Scalars("loss")]
    assert len(steps) == 3000 and sorted(steps) == list(range(3000)), (
        f"{len(steps)} points for 3000 steps; {len(steps) - len(set(steps))} doubled"
    )
