"""The worker class of ``bench_verl.py``'s calls part (importable by name in every Ray worker)."""

from __future__ import annotations

import time

import ray
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register


@ray.remote
class BenchWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def noop(self, x: int) -> int:
        return x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def work20(self, x: int) -> int:
        time.sleep(0.02)  # a call that does 20 ms of work
        return x
