"""One process holding many simulated ranks of the scale bench (``bench_scale.py`` starts it).

    python bench/scale_ranks.py --driver HOST:PORT --host-index I --ranks FIRST:COUNT --world N ...

A rank here is what one verl worker process is, as far as telemetry goes, built through the
library's own parts:

* its *worker run*: the ``Run`` that ``distributed/worker.py`` builds for a process without
  ``Tracking`` (settings from ``build_worker_settings``, OTLP sinks from ``build_otlp_sinks``, the
  env sinks, ``driver=False``), with the rank's own identity (``ml.rank``, ``ml.role``, ``host.name``
  = its node, the job's run id) and covered, as the driver's drain makes a verl worker: its spans
  and records leave every 5 s (``export_less_often``; scaled with ``--step-s``, see below), and a
  call returns at once;
* its worker methods, each wrapped by the covered worker's real worker-side wrapper
  (``verl/dispatch.py``'s ``_taking_carrier``: the carrier read once, the caller's trace continued,
  ``at_call_end``), opening ``trace_state`` spans as DistProfiler's do (~20 per step);
* its stall records: every run is watched by the process's one stall watcher, as in a worker.

Stand-ins, and only these: the ranks share a process (one thread each, so a rank stuck in a phase
is stuck in its own thread); ``trace_state`` finds the calling thread's rank's run (in a real worker
``current_run()`` finds the process's one run); ``process.pid`` is the host process's; the drain's
"you are covered" message is set directly rather than sent through ``__ray_call__``; the calls
arrive over a socket from the driver instead of Ray's actor-call transport.

Time: a step of ``--step-s`` seconds stands for a 10 s step; the covered export interval is scaled
with it (5 s x step_s / 10), so that each rank makes as many exports per step as at 10 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import random
import resource
import sys
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MAGIC = "verl_magic_attr"  # what verl's MAGIC_ATTR names (any name: the wrapper copies the dict)
ROLE = "actor"  # verl's fused actor/rollout/ref worker: one group of N ranks does every phase

# Each worker-group call of a step: (the driver's phase, the method, the spans inside the call).
# With the call's own span: 7 + 3 + 3 + 7 = 20 spans per rank per step.
CALLS: list[tuple[str, str, tuple[str, ...]]] = [
    ("gen", "generate_sequences", ("wake_up", "generate", "generate", "generate", "generate", "sleep")),
    ("old_log_prob", "compute_log_prob", ("forward", "forward")),
    ("ref", "compute_ref_log_prob", ("forward", "forward")),
    ("update_actor", "update_actor", ("forward_backward",) * 4 + ("clip_grad", "optimizer_step")),
]
SPANS_PER_STEP = sum(1 + len(inner) for _, _, inner in CALLS)


def thread_cpu_s(thread: threading.Thread) -> float:
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[arg-type]
    except (OSError, TypeError, ValueError):  # ended meanwhile
        return 0.0


def otel_threads_cpu_s() -> float:
    return sum(thread_cpu_s(t) for t in threading.enumerate() if t.name.startswith("otel-tracking"))


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def memory_kb() -> dict[str, int]:
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            found[key] = int(value.split()[0])
    return found


class Host:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        first, count = (int(x) for x in args.ranks.split(":"))
        self.ranks = list(range(first, first + count))
        self.conn = connect(tuple_address(args.driver))
        self.send_lock = threading.Lock()
        self.local = threading.local()
        self.runs: dict[int, Any] = {}
        self.inbox: dict[int, queue.SimpleQueue[Any]] = {}
        self.measuring = False
        self.call_cpu_s = 0.0
        self.calls_measured = 0
        self.spans = 0
        self.stall_records = 0
        self.stuck: tuple[int, str] | None = None
        self.release = threading.Event()
        self.count_lock = threading.Lock()
        self.window: dict[str, float] = {}

    # --- the ranks' runs -------------------------------------------------------------------------

    def build(self) -> None:
        from otel_tracking.api import spans
        from otel_tracking.config.run_config import RunConfig
        from otel_tracking.delivery.env_sinks import build_env_sinks
        from otel_tracking.delivery.otlp_sinks import build_otlp_sinks
        from otel_tracking.distributed import drain
        from otel_tracking.distributed.environment import COVERED_EXPORT_INTERVAL_S, build_worker_settings
        from otel_tracking.distributed.worker import export_less_often
        from otel_tracking.runtime.run import Run

        # trace_state asks which run records its span: the calling rank's (stand-in for a process's one run)
        spans._late.current_run = lambda: getattr(self.local, "run", None)
        drain._covered_pid = os.getpid()  # the driver's drain said "covered" (stand-in for __ray_call__)
        base = build_worker_settings({})
        interval_s = COVERED_EXPORT_INTERVAL_S * self.args.step_s / 10.0
        for rank in self.ranks:
            node = node_of(rank, self.args.ranks_per_node)
            settings = dataclasses.replace(
                base, role=ROLE, rank=rank, host=node, spool_dir=base.spool_dir / f"{ROLE}-{node}-{rank}"
            )
            # distributed/worker.py's _build, for this rank's settings
            otlp = build_otlp_sinks(settings)
            step_sinks, periodic = build_env_sinks(settings, RunConfig(), taken=())
            run = Run(settings, step_sinks, otlp_sinks=otlp, periodic_sinks=periodic, driver=False)
            run.process_worker = True
            if self.args.step_s == 10.0:
                export_less_often(run)
            else:  # export_less_often with the interval scaled to the step
                for sink in run.all_sinks:
                    if sink.queue is not None:
                        sink.queue.hold_for(interval_s)
            report = run.stalls.report

            def counted(stall: Any, report: Any = report) -> None:
                with self.count_lock:
                    self.stall_records += 1
                report(stall)

            run.stalls.report = counted
            self.runs[rank] = run

    # --- the calls -------------------------------------------------------------------------------

    def methods(self) -> dict[str, Any]:
        from otel_tracking.api.spans import trace_state
        from otel_tracking.verl.dispatch import _taking_carrier

        host = self

        def make(name: str, inner: tuple[str, ...]) -> Any:
            def method(worker: Any, budget_s: float) -> None:
                with trace_state(name):
                    per_s = budget_s * worker.jitter / len(inner)
                    for i, sub in enumerate(inner):
                        with trace_state(sub):
                            if i == 0 and host.stuck == (worker.rank, name):
                                host.release.wait()
                            time.sleep(per_s)
                with host.count_lock:
                    host.spans += 1 + len(inner)

            method.__name__ = name
            setattr(method, MAGIC, {})
            return _taking_carrier(method, MAGIC)

        return {name: make(name, inner) for _, name, inner in CALLS}

    def rank_loop(self, rank: int, methods: dict[str, Any]) -> None:
        self.local.run = self.runs[rank]
        worker = Worker(rank, random.Random(rank).uniform(0.9, 1.0))
        inbox = self.inbox[rank]
        while True:
            item = inbox.get()
            if item is None:
                return
            call_id, method_name, kwargs = item
            started = time.thread_time()
            methods[method_name](worker, **kwargs)
            took = time.thread_time() - started
            if self.measuring:
                with self.count_lock:
                    self.call_cpu_s += took
                    self.calls_measured += 1
            ended_ns = time.time_ns()  # the call's end, on this rank (the driver stamps its own when it sees it)
            with self.send_lock:
                self.conn.send(("done", [(call_id, ended_ns)]))

    def serve(self) -> None:
        started = time.monotonic()
        self.build()
        built_s = time.monotonic() - started
        methods = self.methods()
        threads = []
        for rank in self.ranks:
            self.inbox[rank] = queue.SimpleQueue()
            thread = threading.Thread(target=self.rank_loop, args=(rank, methods), name=f"rank-{rank}", daemon=True)
            thread.start()
            threads.append(thread)
        with self.send_lock:
            self.conn.send(("hello", self.args.host_index, os.getpid(), self.ranks, built_s))
        while True:
            message = self.conn.recv()
            kind = message[0]
            if kind == "calls":
                for rank, call_id, method_name, kwargs in message[1]:
                    self.inbox[rank].put((call_id, method_name, kwargs))
            elif kind == "measure":
                self.measure(message[1])
            elif kind == "stuck":
                self.stuck = (message[1], message[2])
            elif kind == "release":
                self.release.set()
            elif kind == "finish":
                for rank in self.ranks:
                    self.inbox[rank].put(None)
                for thread in threads:
                    thread.join(30)
                with self.send_lock:
                    self.conn.send(("stats", self.args.host_index, self.finish()))
                return

    def measure(self, on: bool) -> None:
        now = {"otel_cpu_s": otel_threads_cpu_s(), "process_cpu_s": process_cpu_s(), "wall_s": time.monotonic()}
        if on:
            self.window = {f"start_{k}": v for k, v in now.items()}
        else:
            for key, value in now.items():
                self.window[key] = value - self.window.pop(f"start_{key}")
        self.measuring = on

    def finish(self) -> dict[str, Any]:
        memory = memory_kb()
        started = time.monotonic()
        totals: dict[str, dict[str, int]] = {}
        for run in self.runs.values():
            for sink, counts in run.finish().items():
                into = totals.setdefault(sink, {})
                for key, value in counts.items():
                    into[key] = into.get(key, 0) + value
        return {
            "ranks": len(self.ranks),
            "pid": os.getpid(),
            "spans": self.spans,
            "stall_records": self.stall_records,
            "calls_measured": self.calls_measured,
            "call_cpu_s": self.call_cpu_s,
            "window": self.window,
            "memory_kb": memory,
            "sinks": totals,
            "finish_s": time.monotonic() - started,
        }


@dataclasses.dataclass
class Worker:
    rank: int
    jitter: float  # this rank's share of a phase's budget: ranks finish at different times


def node_of(rank: int, ranks_per_node: int) -> str:
    return f"node-{rank // ranks_per_node:04d}"


def connect(address: tuple[str, int], timeout_s: float = 60.0) -> Any:
    """The driver's listener (it may not listen yet: the bench starts both at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=b"scale")
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def tuple_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--driver", required=True)
    parser.add_argument("--host-index", type=int, required=True)
    parser.add_argument("--ranks", required=True, help="FIRST:COUNT")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=10.0)
    Host(parser.parse_args()).serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
