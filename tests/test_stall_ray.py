"""A stall report while Ray's GCS does not answer: the driver's phase waits for an actor's call,
and the GCS process is stopped (SIGSTOP) before the phase passes its bound.  Whom the phase waits
for is asked of Ray (its object store and the GCS's actor table, ``verl/waiting.py``) on a thread
of the stall watcher's own; the reports still go out, saying what could not be found, and the
watcher keeps reporting other phases.  A real local Ray cluster, its real GCS process."""

from __future__ import annotations

import os
import signal
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from otel_tracking import Tracking, trace_state
from otel_tracking.runtime import stall_report
from otel_tracking.verl import waiting
from tests.otlp_receiver import wait_for
from tests.test_stalls import _stalls_of

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cluster() -> Iterator[None]:
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}
    )
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote
class Rank:
    def busy(self, flag: str) -> int:
        """A call that does not return until the test creates ``flag``."""
        while not os.path.exists(flag):
            threading.Event().wait(0.05)
        return 1


def _gcs_pid() -> int:
    from ray._private import ray_constants, worker

    (gcs,) = worker._global_node.all_processes[ray_constants.PROCESS_TYPE_GCS_SERVER]
    return int(gcs.process.pid)


def test_a_gcs_that_does_not_answer_costs_the_report_its_ranks_not_the_watcher(
    cluster: None, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = isolated / "come-back"
    monkeypatch.setenv("OTEL_TRACKING_STALL_AFTER", "1")
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(isolated / "logs"))
    monkeypatch.setattr(stall_report, "_waiting_sources", [waiting.waiting_for])  # as the verl switch adds it
    events = isolated / "logs" / "proj" / "exp.events.jsonl"
    rank = Rank.remote()  # type: ignore[attr-defined]
    group: Any = types.SimpleNamespace(_workers=[rank])
    tracking = Tracking("proj", "exp", default_backend=["file"])
    gcs = _gcs_pid()
    try:
        with trace_state("update_actor", step=1):
            ref = rank.busy.remote(str(flag))
            waiting.remember(group, rank, ref)
            os.kill(gcs, signal.SIGSTOP)  # the GCS stops answering
            (first, *_) = wait_for(lambda: _stalls_of(events, "update_actor"), timeout_s=60, what="the first report")
            with trace_state("save_checkpoint", step=1):  # the watcher is not stuck: it reports this too
                (later, *_) = wait_for(lambda: _stalls_of(events, "save_checkpoint"), timeout_s=60, what="a later one")
            os.kill(gcs, signal.SIGCONT)
            flag.touch()
            assert ray.get(ref, timeout=120) == 1
    finally:
        os.kill(gcs, signal.SIGCONT)
        flag.touch()
    tracking.log({"loss": 1.0}, 1)
    tracking.finish()
    unknown = first["attributes"].get("ml.stall.waiting_unknown", "")
    assert "did not answer within" in unknown or "earlier lookup" in unknown, first["attributes"]
    assert "not known" in later["attributes"].get("ml.stall.waiting_unknown", ""), later["attributes"]
