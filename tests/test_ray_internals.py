"""The contract with Ray's private names (``otel_tracking/compat/ray_internals.py``).

Each name is checked against the installed Ray on a real local cluster by what Ray says publicly of
the same thing (the runtime context's actor id, the actor's own pid), so this test fails when a
Ray upgrade moves one of them; and a moved name is a warning and its documented fallback, never an
error in the training process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import ray

from otel_tracking.compat import ray_internals


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote
class Probe:
    def update(self, batch: int, *, lr: float = 0.1) -> int:
        return batch

    def who(self) -> tuple[str, int, bool]:
        from otel_tracking.compat.ray_internals import is_driver

        return ray.get_runtime_context().get_actor_id(), os.getpid(), is_driver()


def test_every_private_name_is_in_the_installed_ray(cluster: None) -> None:
    assert ray_internals.probe() == {name: True for name in ray_internals.PRIVATE_NAMES}, ray.__version__


def test_each_name_reads_what_ray_says_publicly(cluster: None) -> None:
    actor = Probe.remote()  # type: ignore[attr-defined]
    public_id, pid, actor_is_driver = ray.get(actor.who.remote())
    assert ray_internals.actor_id(actor) == public_id
    assert ray_internals.is_driver() and not actor_is_driver  # this test ran ray.init; the actor did not
    names = [p.name for p in ray_internals.method_parameters(actor, "update")]
    assert names[:2] == ["batch", "lr"]  # Ray appends its own (_ray_trace_ctx)
    entry = ray_internals.job_actor_table()[public_id]  # this job's actors, in one query
    assert entry["Pid"] == pid and entry["State"] == "ALIVE"
    assert ray_internals.actor_id(object()) is None  # not a handle: no id, no error


def test_a_moved_name_warns_once_and_its_fallback_runs(
    cluster: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Ray without ``global_worker.mode`` (as if it moved): no process is the driver (each call then
    waits for its spans), with one warning that says so, and no exception."""
    monkeypatch.setattr(ray._private.worker, "global_worker", SimpleNamespace())
    monkeypatch.setattr(ray_internals, "_probed", None)
    with caplog.at_level(logging.DEBUG, logger="otel_tracking.ray"):
        assert ray_internals.is_driver() is False
        assert ray_internals.is_driver() is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "otel-tracking: Ray's ray._private.worker.global_worker.mode is not in this Ray: "
        + ray_internals.PRIVATE_NAMES["ray._private.worker.global_worker.mode"]
    ]
    used = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert "otel-tracking: Ray's ray._private.state.state.actor_table is used" in used
    monkeypatch.setattr(ray_internals, "_probed", None)  # the next test probes the real Ray again
