"""When each rank's result was ready (``verl/returns.py``), on a real local Ray cluster: the
driver's watcher hands ``ray.wait`` a bounded number of refs per result, whatever the number of
ranks, and the step's anatomy still names the rank whose result came last.

One async actor stands for the ranks (each worker-group call is one of its calls, returning
after its rank's delay: results one at a time, 1 ms apart, the last 100 ms after those, the
pattern that cost the watcher every outstanding ref per result before).  ``ray.wait`` is Ray's
own, counted on the way in."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from otel_tracking import Tracking, trace_state
from otel_tracking.exporters.file import read_anatomy
from otel_tracking.verl import returns

GAP_S = 0.001  # between two ranks' results
STRAGGLER_S = 0.25  # the last rank's, after that


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote
class Ranks:
    async def update_actor(self, delay_s: float) -> int:
        await asyncio.sleep(delay_s)
        return 0


class Group:
    """What verl's ``RayWorkerGroup`` shows ``returns.sent``: its workers, in rank order."""

    def __init__(self, size: int) -> None:
        self.workers = [object() for _ in range(size)]


def test_the_refs_handed_to_ray_wait_per_result_do_not_grow_with_the_ranks(
    cluster: None, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed: list[int] = []
    real_wait = ray.wait

    def counted_wait(refs: Any, *args: Any, **kwargs: Any) -> Any:
        handed.append(len(refs))
        return real_wait(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "wait", counted_wait)
    monkeypatch.setenv("OTEL_TRACKING_ANATOMY", "1")
    ranks = Ranks.remote()  # type: ignore[attr-defined]
    ray.get(ranks.update_actor.remote(0))
    tracking = Tracking("proj", "exp", default_backend=["file"])
    per_result = {}
    for step, world in ((1, 32), (2, 256)):
        group = Group(world)
        handed.clear()
        began = time.monotonic()
        with trace_state("update_actor"):
            refs = []
            for rank, worker in enumerate(group.workers):
                # the straggler, well apart from the others: a result the watcher stamps late
                # on a loaded machine (by design up to 50 ms) must not pass it
                last = STRAGGLER_S if rank == world - 1 else 0.0
                refs.append(ranks.update_actor.remote(0.05 + rank * GAP_S + last))
                returns.sent(group, worker, "update_actor", refs[-1])
            ray.get(refs)
        deadline = time.monotonic() + 60
        while returns._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not returns._pending, "the watcher did not see every result"
        waited_s = time.monotonic() - began
        tracking.log({"loss": 1.0}, step)
        # Each wait hands in the outstanding refs twice at most, and returns once a 1/_BATCH of
        # them is ready or once _WAIT_PER_CALL_S per ref has passed: per result, or per time.
        bound = 2 * returns._BATCH * world + 2 * waited_s / returns._WAIT_PER_CALL_S
        assert sum(handed) <= bound, (world, sum(handed), bound, len(handed))
        per_result[world] = sum(handed) / world
    tracking.finish()
    anatomy = read_anatomy(isolated / "proj" / "exp.jsonl")
    assert anatomy[1]["anatomy/update_actor/straggler_rank"] == 31
    assert anatomy[2]["anatomy/update_actor/straggler_rank"] == 255
    # the last rank ended about (world / 2) ms + STRAGGLER_S after the median one
    assert STRAGGLER_S <= anatomy[2]["anatomy/update_actor/straggler_lag_s"] <= 2.0, anatomy[2]
    print("refs handed to ray.wait per result:", per_result)
