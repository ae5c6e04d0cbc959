"""Worker classes of the verl-shaped test loop, built the way verl builds its own: ``Worker``
subclasses whose methods carry ``@register`` and ``@DistProfiler.annotate``.

Importable by name (``tests/verl`` on ``PYTHONPATH``; the name is unique because verl's wheel
installs a top-level ``tests`` package), so that every process decorates them at import, as it
does verl's ``verl.workers.*`` classes."""

from __future__ import annotations

import asyncio
import os
import time

import ray
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.profiler import DistProfiler
from verl.utils.tracking import RLInsightLogger


def stuck_until_released(flag: str, busy: bool) -> None:
    """A rank that hangs (test_stall.py) until the test creates ``flag``: in a GIL-releasing wait,
    or ``busy`` in a pure-Python loop that never yields."""
    deadline = time.monotonic() + 120
    while not os.path.exists(flag) and time.monotonic() < deadline:
        if not busy:
            time.sleep(0.05)


def batch(n: int = 4) -> DataProto:
    return DataProto(batch=TensorDict({"input": torch.arange(n, dtype=torch.float32)}, batch_size=[n]))


class _Profiled(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.profiler = DistProfiler(rank=self.rank)  # disabled, as in a default verl config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def flush_telemetry(self) -> None:
        """The loop's last call: Ray kills a job's actors when its driver exits, and a worker's
        spans of the last export interval (100 ms) can go with it.  Switched off there is no run."""
        from otel_tracking.runtime.run import current_run

        run = current_run()
        if run is not None:
            run.flush()


@ray.remote
class ActorWorker(_Profiled):
    def __init__(self) -> None:
        super().__init__()
        if "LOOP_START_FLAG" in os.environ:  # test_stall.py: a slow start (a model's imports and load)
            stuck_until_released(os.environ["LOOP_START_FLAG"], busy=False)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate(color="red", role="actor_update")
    def update_actor(self, data: DataProto) -> DataProto:
        self._updates = getattr(self, "_updates", 0) + 1
        if os.environ.get("LOOP_STALL_RANK") == str(self.rank) and str(self._updates) == os.environ["LOOP_STALL_CALL"]:
            stuck_until_released(os.environ["LOOP_STALL_FLAG"], os.environ.get("LOOP_STALL_BUSY") == "1")
        if "LOOP_UPDATE_S" in os.environ:  # test_anatomy.py: each rank's seconds, "0.2,0.2,0.2,0.6"
            started = time.perf_counter()
            time.sleep(float(os.environ["LOOP_UPDATE_S"].split(",")[self.rank]))
            data.batch["took"] = torch.full_like(data.batch["input"], time.perf_counter() - started)
        data.batch["output"] = data.batch["input"] * 2 + self.rank
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    @DistProfiler.annotate(color="blue", role="actor_compute_log_prob")
    def compute_log_prob(self, data: DataProto) -> DataProto:
        data.batch["log_prob"] = data.batch["input"] - self.rank
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def generate(self, scale: int) -> float:
        """Async, as the rollout servers are: their ``trace_state`` is called directly."""
        with RLInsightLogger.trace_state("actor_generate", state_lane_id=f"rank_{self.rank}"):
            await asyncio.sleep(0)
            return float(scale * (self.rank + 1))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @DistProfiler.annotate(role="actor_shard")
    def shard(self, value: int) -> int:
        """Called with execute_all_sync and one list item per worker (list-split)."""
        return value + self.rank

    def plain(self, value: int) -> int:
        """No @register: called by name, it must get no keyword it does not know."""
        return value * 10


@ray.remote
class RefWorker(_Profiled):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate(role="ref_compute_ref_log_prob")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        data.batch["ref_log_prob"] = data.batch["input"] + 100
        return data
