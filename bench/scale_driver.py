"""The scale bench's driver (``bench_scale.py`` starts it): a verl-shaped training loop against N
simulated ranks held by a few host processes (``scale_ranks.py``).

What is real: ``Tracking`` (file sink, OTLP to the node agent), ``trace_state`` for verl's
``marked_timer`` phases (``step``, ``gen``, ``old_log_prob``, ``ref``, ``adv``, ``update_actor``),
the step roots and the step anatomy (``OTEL_TRACKING_ANATOMY=1``, as ``OTEL_TRACKING_VERL`` turns
it on), the stall watcher, and ``verl/dispatch.py``'s driver-side wrapper of
``RayWorkerGroup._execute_remote_single_worker`` with what it calls per worker-group call (the
carrier, ``verl/waiting.py``'s ``remember``, ``verl/returns.py``'s ``sent`` and its watcher thread).

Stand-ins: ``RayWorkerGroup`` here is a class of the same name whose
``_execute_remote_single_worker`` sends the call to the rank's host process instead of Ray; the
refs, ``ray.wait``/``ray.get`` and the actor table are ``scale_ray.py``'s; the group's
"takes a carrier" answer is given (verl's ``MAGIC_ATTR`` lookup needs verl's classes).

Prints one JSON document on its last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
import types
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import scale_ray  # noqa: E402  (before anything imports Ray)

scale_ray.install({"OTEL_TRACKING_VERL": "1"})

from scale_ranks import CALLS, SPANS_PER_STEP, memory_kb, node_of, thread_cpu_s  # noqa: E402

PHASE_SHARE = {"gen": 0.4, "old_log_prob": 0.1, "ref": 0.1, "update_actor": 0.3}  # of the step
PHASE_OF = {method: phase for phase, method, _ in CALLS}
DRIVER_SPANS_PER_STEP = 7  # the step root, "step", gen, old_log_prob, ref, adv, update_actor
METRICS = {f"actor/metric_{i}": float(i) for i in range(100)}  # what a verl step logs, about


class Calls:
    """Where the worker-group stand-in sends calls, and where their results come back."""

    def __init__(self) -> None:
        self.conns: dict[int, Any] = {}
        self.outbox: dict[int, list[Any]] = {}
        self.refs: dict[int, scale_ray.ObjectRef] = {}
        self.step = 0
        self.sent: dict[int, tuple[int, str, int]] = {}  # call id -> (rank, the driver phase it was sent under, step)
        self.rank_ended: dict[tuple[int, str, int], int] = {}  # (rank, phase, step) -> when the rank's call ended
        self.lock = threading.Lock()
        self.stats: dict[int, Any] = {}
        self.stats_done = threading.Event()
        self.send_lock = threading.Lock()  # the main thread and the stuck rank's releaser both send

    def send(self, host: int, message: Any) -> None:
        with self.send_lock:
            self.conns[host].send(message)

    def flush(self) -> None:
        for host, calls in self.outbox.items():
            if calls:
                self.send(host, ("calls", calls))
                self.outbox[host] = []

    def read(self, host: int) -> None:
        conn = self.conns[host]
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message[0] == "done":
                with self.lock:
                    ready = [self.refs.pop(call_id) for call_id, _ in message[1]]
                    for call_id, ended_ns in message[1]:
                        self.rank_ended[self.sent.pop(call_id)] = ended_ns
                scale_ray.mark_ready(ready)
            elif message[0] == "stats":
                self.stats[message[1]] = message[2]
                if len(self.stats) == len(self.conns):
                    self.stats_done.set()
                return


CALLS_OUT = Calls()


class RayWorkerGroup:
    """verl's worker group, as far as ``dispatch.py`` sees it: ``workers`` (handles, in rank
    order) and ``_execute_remote_single_worker``, the one method every call goes through."""

    def __init__(self, workers: list[scale_ray.ActorHandle]) -> None:
        self.workers = workers
        # dispatch.py asks verl's class whether a method takes the carrier (MAGIC_ATTR): ours do
        self._otel_tracking_takes_carrier = {name: True for _, name, _ in CALLS}

    def _execute_remote_single_worker(self, worker: Any, method_name: str, *args: Any, **kwargs: Any) -> Any:
        ref = scale_ray.ObjectRef()
        with CALLS_OUT.lock:
            CALLS_OUT.refs[ref.call_id] = ref
            CALLS_OUT.sent[ref.call_id] = (worker.rank, PHASE_OF[method_name], CALLS_OUT.step)
        CALLS_OUT.outbox[worker.host].append((worker.rank, ref.call_id, method_name, kwargs))
        return ref

    def execute_all(self, method_name: str, **kwargs: Any) -> list[Any]:
        refs = [self._execute_remote_single_worker(w, method_name, **kwargs) for w in self.workers]
        CALLS_OUT.flush()
        return refs


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(func: Any, *args: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    result = func(*args)
    return result, time.perf_counter() - wall, time.thread_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", type=int, required=True)
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=10.0)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--stuck-rank", type=int, default=-1)
    parser.add_argument("--bound-s", type=float, required=True)
    args = parser.parse_args()

    base = types.ModuleType("verl.single_controller.ray.base")  # dispatch.py patches this module's class
    base.RayWorkerGroup = RayWorkerGroup  # type: ignore[attr-defined]
    from otel_tracking.verl import dispatch

    dispatch.patch(base)

    listener = Listener(("127.0.0.1", args.listen), authkey=b"scale")
    handles: dict[int, scale_ray.ActorHandle] = {}
    build_s = []
    for _ in range(args.hosts):
        conn = listener.accept()
        _, host, pid, ranks, built_s = conn.recv()
        build_s.append(built_s)
        CALLS_OUT.conns[host] = conn
        CALLS_OUT.outbox[host] = []
        for rank in ranks:
            handles[rank] = scale_ray.ActorHandle(rank, host)
            scale_ray.register_actor(handles[rank], node_of(rank, args.ranks_per_node), pid)
    for host in CALLS_OUT.conns:
        threading.Thread(target=CALLS_OUT.read, args=(host,), name=f"bench-read-{host}", daemon=True).start()
    group = base.RayWorkerGroup([handles[r] for r in range(args.world)])  # type: ignore[attr-defined]

    from otel_tracking import Tracking, trace_state
    from otel_tracking.runtime.run import current_run

    tracking = Tracking("bench", "scale", default_backend=["file"])
    run = current_run()
    assert run is not None and run.anatomy is not None, "the driver's run must measure its steps' anatomy"

    # Observers only: they time and note what the run does, and call it unchanged.
    from otel_tracking.runtime import anatomy

    ended: list[dict[str, Any]] = []
    step_ended = run.anatomy.step_ended
    # How late the driver stamped each rank's call end (verl/returns.py: when it saw the result),
    # against when the call ended on the rank: the calls the anatomy is told of as they end, and
    # those still out when the step is measured (they end with their phase).
    told: dict[int, list[Any]] = {}  # trace id -> its calls, compared after the run, off the step's path
    measured_calls: list[tuple[int, list[Any]]] = []
    call_ended = run.anatomy.call_ended

    def observed_call_ended(trace_id: int, call: Any) -> None:
        told.setdefault(trace_id, []).append(call)
        call_ended(trace_id, call)

    def observed_source(source: Any) -> Any:
        def still_out(trace_id: int) -> Any:
            found = list(source(trace_id))
            told.setdefault(trace_id, []).extend(found)
            return found

        still_out.observed = True  # type: ignore[attr-defined]
        return still_out

    def observed_step_ended(step: Any, traces: Any) -> Any:
        traces = list(traces)
        anatomy._sources[:] = [s if getattr(s, "observed", False) else observed_source(s) for s in anatomy._sources]
        wall, cpu = time.perf_counter(), time.thread_time()
        found = step_ended(step, traces)
        took_s, took_cpu_s = time.perf_counter() - wall, time.thread_time() - cpu
        if step is not None:
            measured_calls.append((step, [c for t in traces for c in told.pop(t.trace_id, [])]))
        ended.append(
            {
                "trace_id": f"{traces[0].trace_id:032x}" if traces else "",
                "step": step,
                "end_ns": max((t.end_ns for t in traces), default=0),
                "anatomy_s": took_s,
                "anatomy_cpu_s": took_cpu_s,
                "metrics": len(found.metrics()) if found is not None else 0,
                "straggler": dict(found.stragglers) if found is not None else {},
            }
        )
        return found

    run.anatomy.step_ended = observed_step_ended  # type: ignore[method-assign]
    run.anatomy.call_ended = observed_call_ended  # type: ignore[method-assign]
    stalls: list[dict[str, Any]] = []
    report = run.stalls.report

    def observed_report(stall: Any) -> None:
        stalls.append(
            {
                "phase": stall.phase,
                "at_ns": time.time_ns(),
                "span_start_ns": stall.span.start_time,
                "waiting": list(stall.waiting.waiting),
                "done": len(stall.waiting.done),
                "body_chars": len(stall.stacks),
            }
        )
        report(stall)

    run.stalls.report = observed_report

    def named_stuck() -> bool:
        return any(s["phase"] == "update_actor" and s["waiting"] == [args.stuck_rank] for s in stalls)

    steps: list[dict[str, Any]] = []
    stuck: dict[str, Any] = {}
    warmup = 1
    total = warmup + args.steps + (1 if args.stuck_rank >= 0 else 0)
    threads = {t.name: t for t in threading.enumerate()}
    for step in range(1, total + 1):
        measured = warmup < step <= warmup + args.steps
        stuck_step = step == total and args.stuck_rank >= 0
        if step == warmup + 1:
            for host in CALLS_OUT.conns:
                CALLS_OUT.send(host, ("measure", True))
        if stuck_step:
            for host in CALLS_OUT.conns:
                CALLS_OUT.send(host, ("measure", False))
            CALLS_OUT.send(handles[args.stuck_rank].host, ("stuck", args.stuck_rank, "update_actor"))
        CALLS_OUT.step = step
        threads = {t.name: t for t in threading.enumerate()}
        watcher_cpu = {n: thread_cpu_s(t) for n, t in threads.items() if n.startswith("otel-tracking")}
        t0, cpu0 = time.monotonic(), cpu_s()
        waits0 = dict(scale_ray.counts)
        record: dict[str, Any] = {"step": step, "measured": measured}
        state = trace_state("step")
        _, record["enter_s"], record["enter_cpu_s"] = timed(state.__enter__)  # ends the last step's root
        dispatch_s = dispatch_cpu_s = 0.0
        for phase, method, _ in CALLS:
            if phase == "update_actor":
                with trace_state("adv"):
                    time.sleep(0.01)
            with trace_state(phase) as span:
                budget = PHASE_SHARE[phase] * args.step_s
                refs, wall, cpu = timed(lambda m=method, b=budget: group.execute_all(m, budget_s=b))
                dispatch_s += wall
                dispatch_cpu_s += cpu
                if stuck_step and phase == "update_actor":
                    stuck["phase_start_ns"] = span.start_time  # type: ignore[attr-defined]
                    threading.Thread(
                        target=release_when_named, args=(args, handles, named_stuck, stuck), daemon=True
                    ).start()
                scale_ray.get(refs)
        state.__exit__(None, None, None)
        record["dispatch_s"], record["dispatch_cpu_s"] = dispatch_s, dispatch_cpu_s
        _, record["log_s"], record["log_cpu_s"] = timed(tracking.log, METRICS, step)
        sleep_s = t0 + args.step_s - time.monotonic()
        record["late_s"] = max(0.0, -sleep_s)
        if sleep_s > 0:
            time.sleep(sleep_s)
        record["process_cpu_s"] = cpu_s() - cpu0
        now = {n: thread_cpu_s(t) for n, t in threads.items() if n.startswith("otel-tracking")}
        record["otel_threads_cpu_s"] = {n: now[n] - watcher_cpu.get(n, 0.0) for n in now}
        record["ray_wait"] = {k: v - waits0[k] for k, v in scale_ray.counts.items()}
        steps.append(record)
        if stuck_step:
            stuck["released"] = True
    # the last step's root ends at the next phase or flush(): flush, as the end of training does
    _, flush_s, flush_cpu_s = timed(run.flush, 30.0)
    stats = tracking.finish()
    memory = memory_kb()
    for host in CALLS_OUT.conns:
        CALLS_OUT.send(host, ("finish",))
    CALLS_OUT.stats_done.wait(300)
    stuck["records"] = [s for s in stalls]
    ended_at = CALLS_OUT.rank_ended
    stamp_lags = [
        [c.end_ns - ended_at[(c.rank, c.phase, step)] for c in calls if (c.rank, c.phase, step) in ended_at]
        for step, calls in measured_calls
    ]
    print(
        json.dumps(
            {
                "world": args.world,
                "hosts": args.hosts,
                "build_s": build_s,
                "steps": steps,
                "ended": ended,
                "stuck": stuck,
                "stuck_rank": args.stuck_rank,
                "flush_s": flush_s,
                "flush_cpu_s": flush_cpu_s,
                "driver_sinks": stats,
                "driver_memory_kb": memory,
                "driver_spans": DRIVER_SPANS_PER_STEP * total,
                "rank_spans_per_step": SPANS_PER_STEP,
                "host_stats": CALLS_OUT.stats,
                "driver_stall_records": len(stalls),
                "stamp_lags_ns": stamp_lags,
            }
        ),
        flush=True,
    )
    return 0


def returns_watcher(worlds: list[int], spread_s: float = 0.4) -> list[dict[str, Any]]:
    """``verl/returns.py``'s watcher thread alone, for each N: N calls out, their results ready one
    at a time over ``spread_s`` (the last ranks of a phase finishing), counted in the stand-in's
    ``ray.wait``: calls, refs handed in, and the thread's CPU."""
    from types import SimpleNamespace

    from otel_tracking.runtime.anatomy import StepAnatomy
    from otel_tracking.verl import returns

    thread = None
    found = []
    told = StepAnatomy()
    for world in worlds:
        refs = [scale_ray.ObjectRef() for _ in range(world)]
        span = SimpleNamespace(name="update_actor", end_time=None)
        with returns._cond:
            for rank, ref in enumerate(refs):
                returns._pending[ref] = returns._Sent(world, span, "actor", rank, world, time.time_ns(), told)
                returns._by_trace.setdefault(world, set()).add(ref)
            returns._cond.notify()
        if thread is None:  # what returns.sent() starts on the first call
            thread = threading.Thread(target=returns._watch, name="otel-tracking-returns", daemon=True)
            thread.start()
        time.sleep(0.1)
        cpu0, waits0 = thread_cpu_s(thread), dict(scale_ray.counts)
        ready_ns = []
        for ref in refs:
            ready_ns.append(time.time_ns())
            scale_ray.mark_ready([ref])
            time.sleep(spread_s / world)
        while returns._pending:
            time.sleep(0.01)
        cpu = thread_cpu_s(thread) - cpu0
        waits = {k: v - waits0[k] for k, v in scale_ray.counts.items()}
        returns.calls_of(world)
        # how late each result was stamped: the watcher's end against when it was made ready
        late_ms = sorted((call.end_ns - ready_ns[int(call.rank)]) / 1e6 for call, _ in told._calls.pop(world).calls)
        found.append(
            {
                "world": world,
                "cpu_ms": cpu * 1e3,
                **waits,
                "refs_per_call": waits["wait_refs"] / world,
                "late_p50_ms": late_ms[len(late_ms) // 2],
                "late_p99_ms": late_ms[int(0.99 * (len(late_ms) - 1))],
                "late_max_ms": late_ms[-1],
            }
        )
    return found


def release_when_named(args: argparse.Namespace, handles: dict[int, Any], named: Any, stuck: dict[str, Any]) -> None:
    """The stuck rank stays stuck until the driver's record named it and the rank's own watcher had
    its turn too (1.3 bounds, at least a bound and 2 s, since the phase began), at most 6 bounds."""
    deadline = time.monotonic() + 6 * args.bound_s
    while not named() and time.monotonic() < deadline:
        time.sleep(0.05)
    stuck["named"] = named()
    wait_until_ns = stuck["phase_start_ns"] + int(max(1.3 * args.bound_s, args.bound_s + 2.0) * 1e9)
    while time.time_ns() < wait_until_ns and time.monotonic() < deadline:
        time.sleep(0.05)
    CALLS_OUT.send(handles[args.stuck_rank].host, ("release",))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--returns-watcher"]:
        print(json.dumps(returns_watcher([int(w) for w in sys.argv[2].split(",")])), flush=True)
        raise SystemExit(0)
    os.environ.setdefault("OTEL_TRACKING_ANATOMY", "1")
    raise SystemExit(main())
