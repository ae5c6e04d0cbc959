"""verl, unchanged: what the instrumentation costs a verl run.  Run with the verl venv's python
(``scripts/verl-venv`` prints it):

    $(scripts/verl-venv) bench/bench_verl.py                  # every part
    $(scripts/verl-venv) bench/bench_verl.py --parts micro,import

Parts (each instrumented run beside the same thing uninstrumented, in a process of its own):

  calls   a real ``RayWorkerGroup`` of 2 workers on a local Ray cluster: the wall time of one
          worker-group call (a no-op method, and one that works 20 ms), p50 and p90, with
          ``OTEL_TRACKING_VERL=1`` and without; inside a ``marked_timer`` phase, as in verl.
  micro   the wrappers alone, in one process: the driver side (``_execute_remote_single_worker``:
          which method, the carrier), the worker side (``register``'s wrapper: the carrier
          attached and detached), and Ray's ``ActorHandle._actor_method_call`` as hops.py wraps
          it, each beside verl's (Ray's) own function; p50 per call.
  import  ``python -c "import verl"``: switched on, switched off (the plugin loads and does
          nothing), and no plugins at all (``VERL_USE_EXTERNAL_PLUGINS=none``); median wall time.
  cpu     a worker's ``DistProfiler.annotate``d method called 200 times a second for
          --cpu-seconds, its spans exported over OTLP to a local endpoint: CPU seconds per wall
          second (all threads), beside the same worker uninstrumented.  Twice: a Ray actor its
          driver covers (``distributed/drain.py``: calls return at once), also beside the plain
          OTel SDK alone in that actor (``BatchSpanProcessor`` + OTLP/HTTP, same endpoint), and the
          method called in a process nobody covers (each call's end waits until its spans have left).
  span    the same annotated method in one process, covered, at full speed: CPU µs of the calling
          thread per call, and CPU µs of the process per span while its held spans are exported
          (a flush), best of 7 repeats of 2000 calls; off, the plain SDK alone, ours (and
          --before).  Steadier than ``cpu`` (no Ray, no pacing), so a few µs show.

Results: bench/results/<UTC date>-<label>.json and .md (label ``verl`` unless --label), with the
machine's load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env.update(extra)
    return env


def child(spec: dict[str, Any], env: dict[str, str], cwd: str | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(HERE), "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- calls ---------------------------------------------------------------------------------------


def child_calls(spec: dict[str, Any]) -> dict[str, Any]:
    import ray

    sys.path.insert(0, str(HERE.parent))
    from bench_verl_workers import BenchWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.profiler import marked_timer
    from verl.utils.tracking import Tracking

    ray.init(address=spec["address"], runtime_env={"env_vars": {"PYTHONPATH": str(HERE.parent)}})
    tracking = Tracking("bench", "calls", default_backend=["file"])
    group = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(cls=BenchWorker))
    group.noop(0)  # warm
    out: dict[str, Any] = {}
    for method, calls in (("noop", spec["calls"]), ("work20", spec["calls20"])):
        times = []
        timing: dict[str, float] = {}
        with marked_timer(method, timing):
            for i in range(calls):
                start = time.perf_counter()
                getattr(group, method)(i)
                times.append(time.perf_counter() - start)
        out[method] = {"p50_ms": 1000 * pct(times, 0.5), "p90_ms": 1000 * pct(times, 0.9), "calls": calls}
    tracking.log({"done": 1}, 1)
    return out


def part_calls(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import ray

    ray.init(num_cpus=100, include_dashboard=False, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        spec = {"mode": "calls", "address": address, "calls": args.calls, "calls20": args.calls20}
        result: dict[str, Any] = {"off": [], "on": []}
        for _ in range(args.rounds):  # interleaved: the machine's load hits both alike
            for mode in ("off", "on"):
                extra = {"OTEL_TRACKING_VERL": "1"} if mode == "on" else {}
                env = clean_env(VERL_FILE_LOGGER_PATH=str(tmp / f"{mode}.jsonl"), OTEL_TRACES_EXPORTER="none",
                                OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
                                OTEL_TRACKING_SPOOL_DIR=str(tmp / "spool"), **extra)  # fmt: skip
                result[mode].append(child(spec, env))
    finally:
        ray.shutdown()
    summary: dict[str, Any] = {}
    for method in ("noop", "work20"):
        off = statistics.median(r[method]["p50_ms"] for r in result["off"])
        on = statistics.median(r[method]["p50_ms"] for r in result["on"])
        added = on - off
        summary[method] = {"off_p50_ms": off, "on_p50_ms": on, "added_ms": added, "added_pct": 100 * added / off}
    return {"rounds": result, "summary": summary}


# --- micro ---------------------------------------------------------------------------------------


def child_micro(spec: dict[str, Any]) -> dict[str, Any]:
    from otel_tracking.verl import install

    install("bench")
    import verl.single_controller.base.decorator as decorator
    from opentelemetry import context
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray.base import RayWorkerGroup

    from otel_tracking import Tracking, trace_state
    from otel_tracking.distributed.propagation import inject

    class Work:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def step(self, x: int) -> int:
            return x

        @decorator.verl_register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def verl_step(self, x: int) -> int:
            return x

    class Method:
        def remote(self, *args: Any, **kwargs: Any) -> None:
            return None

    class Handle:
        step = Method()

    class Cls:
        __ray_actor_class__ = Work

    group = object.__new__(RayWorkerGroup)
    group.fused_worker_used = False
    group.ray_cls_with_init = type("CIA", (), {"cls": Cls})()
    from otel_tracking.verl import dispatch

    dispatch._instrumented[:] = [True]  # as in a Ray job whose workers are instrumented (no Ray here)
    ours = RayWorkerGroup._execute_remote_single_worker
    theirs = ours.__wrapped__
    Tracking("bench", "micro", default_backend=[])
    n = spec["n"]
    worker = Work()
    results: dict[str, list[float]] = {"driver_ours": [], "driver_verl": [], "worker_ours": [], "worker_verl": []}
    with trace_state("phase"):
        carrier = inject()
        for _ in range(spec["rounds"]):
            for name, call in (
                ("driver_ours", lambda: ours(group, Handle, "step", 1)),
                ("driver_verl", lambda: theirs(group, Handle, "step", 1)),
            ):
                start = time.perf_counter()
                for _ in range(n):
                    call()
                results[name].append((time.perf_counter() - start) / n)
            token = context.attach(context.Context())  # a worker has no current span of its own
            for name, call in (
                ("worker_ours", lambda: worker.step(1, _otel_context=carrier)),
                ("worker_verl", lambda: worker.verl_step(1)),
            ):
                start = time.perf_counter()
                for _ in range(n):
                    call()
                results[name].append((time.perf_counter() - start) / n)
            context.detach(token)
        results.update(_micro_ray_calls(spec, carrier))  # in the phase, as the hops' calls are
    return {name: 1e6 * statistics.median(values) for name, values in results.items()}


def _micro_ray_calls(spec: dict[str, Any], carrier: dict[str, str]) -> dict[str, list[float]]:
    """``ActorHandle._actor_method_call`` as hops.py wraps it, around a stand-in for Ray's (which
    needs a cluster): a call to a method that takes no carrier (every other actor call), to one
    that takes it and already has it (a worker-group call: dispatch added it), and to one that
    takes it and gets it (the agent-loop and server hops), beside Ray's function alone."""
    import inspect
    import types

    from otel_tracking.verl import hops

    def ray_call(self: Any, method_name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        return None

    x = inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    c = inspect.Parameter(hops.CARRIER, inspect.Parameter.KEYWORD_ONLY, default=None)
    handle_cls = type("ActorHandle", (), {"_actor_method_call": ray_call})
    handle = handle_cls()
    handle._ray_method_signatures = {"plain": [x], "carried": [x, c]}
    hops._patch_caller(types.SimpleNamespace(__name__="ray.actor", ActorHandle=handle_cls))
    ours = handle_cls._actor_method_call
    n = spec["n"]
    results: dict[str, list[float]] = {"ray_verl": [], "ray_other": [], "ray_has_carrier": [], "ray_adds_carrier": []}
    calls = {
        "ray_verl": lambda: ray_call(handle, "plain", (1,), {}),
        "ray_other": lambda: ours(handle, "plain", (1,), {}),
        "ray_has_carrier": lambda: ours(handle, "carried", (1,), {hops.CARRIER: carrier}),
        "ray_adds_carrier": lambda: ours(handle, "carried", (1,), {}),
    }
    for _ in range(spec["rounds"]):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(n):
                call()
            results[name].append((time.perf_counter() - start) / n)
    return results


def part_micro(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    us = child({"mode": "micro", "n": args.micro_n, "rounds": args.micro_rounds},
               clean_env(OTEL_SDK_DISABLED="false", OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                         OTEL_LOGS_EXPORTER="none", OTEL_TRACKING_SPOOL_DIR=str(tmp / "spool")))  # fmt: skip
    return {
        "per_call_us": us,
        "driver_added_us": us["driver_ours"] - us["driver_verl"],
        "worker_added_us": us["worker_ours"] - us["worker_verl"],
        "ray_call_added_us": {k: us[k] - us["ray_verl"] for k in ("ray_other", "ray_has_carrier", "ray_adds_carrier")},
    }


# --- import --------------------------------------------------------------------------------------


def part_import(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    modes = {
        "on": {"OTEL_TRACKING_VERL": "1"},
        "off": {},
        "no_plugins": {"VERL_USE_EXTERNAL_PLUGINS": "none"},
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.import_rounds):
        for mode, extra in modes.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import verl"], env=clean_env(**extra), check=True,
                           capture_output=True)  # fmt: skip
            times[mode].append(time.perf_counter() - start)
    medians = {mode: 1000 * statistics.median(values) for mode, values in times.items()}
    return {"median_ms": medians, "on_minus_no_plugins_ms": medians["on"] - medians["no_plugins"]}


# --- cpu -----------------------------------------------------------------------------------------


# The trace context a driver's phase hands its workers' calls (what ``propagation.inject`` makes).
CARRIER = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", "baggage": "ml.run.id=bench,ml.step=1"}


def _annotated_worker() -> type:
    """A verl worker class whose method is ``DistProfiler.annotate``d and registered, as verl's
    workers' are; with a ``tracer`` set, the plain SDK's span around the call (the ``sdk`` mode)."""
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.utils.profiler import DistProfiler

    class Worker:
        tracer: Any = None

        def __init__(self) -> None:
            self.rank = 0
            self.profiler = DistProfiler(rank=0)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        @DistProfiler.annotate(role="actor_update")
        def update(self, x: int) -> int:
            if self.tracer is not None:
                with self.tracer.start_as_current_span("actor_update", attributes={"ml.rank": 0}):
                    return x
            return x

    return Worker


def _sdk_provider(**batch: Any) -> Any:
    """The plain OpenTelemetry SDK alone: a ``TracerProvider``, a ``BatchSpanProcessor`` (its
    defaults unless ``batch`` says otherwise) and the OTLP/HTTP exporter to the endpoint's variable."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), **batch))
    return provider


def child_cpu(spec: dict[str, Any]) -> dict[str, Any]:
    """A worker nobody covers: the annotated method called in this process, carrier included, so
    each call's end waits until its spans have left (``drain.at_call_end``)."""
    if spec["instrumented"]:
        from otel_tracking.verl import install

        install("bench")
    worker = _annotated_worker()()
    kwargs = {"_otel_context": spec["carrier"]} if spec["instrumented"] else {}
    return paced(lambda i: worker.update(i, **kwargs), spec["rate"], spec["seconds"], _own_cpu)


def child_cpu_ray(spec: dict[str, Any]) -> dict[str, Any]:
    """A Ray actor, called by this driver at the rate: covered (drain.py) when instrumented, so its
    calls return at once; its CPU (all its threads, Ray's too) read by the actor itself.  After
    ``ray.shutdown()`` the part counts the spans that arrived.  ``sdk``: the plain OpenTelemetry SDK
    alone in the same actor, uninstrumented (a ``TracerProvider``, ``BatchSpanProcessor`` with its
    defaults and the OTLP/HTTP exporter to the same endpoint, one span per call), flushed after the
    measured time (nothing covers it)."""
    if spec["instrumented"]:
        from otel_tracking.verl import install

        install("bench")  # as the plugin does on `import verl`: ray.init gets the runtime_env
    import ray

    from otel_tracking import trace_state

    sdk = bool(spec.get("sdk"))

    class Worker(_annotated_worker()):
        def __init__(self) -> None:
            super().__init__()
            if sdk:
                self.provider = _sdk_provider()
                self.tracer = self.provider.get_tracer("bench")

        def flush(self) -> bool:
            return bool(self.provider.force_flush()) if sdk else True

        def cpu_s(self) -> float:
            return _own_cpu()  # this process is __main__: the function travels with the class

        def thread_s(self) -> float:
            return time.thread_time()  # the thread Ray runs this actor's calls on: update()'s too

        def otel_tracking_dir(self) -> str:
            import otel_tracking

            return str(Path(otel_tracking.__file__).parents[1])  # the checkout this actor runs

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        worker = ray.remote(Worker).remote()
        ray.get(worker.update.remote(-1))  # started, its worker run built
        with trace_state("update_actor"):  # the driver's phase: the calls carry its context
            out = paced(lambda i: ray.get(worker.update.remote(i)), spec["rate"], spec["seconds"],
                        lambda: ray.get(worker.cpu_s.remote()), lambda: ray.get(worker.thread_s.remote()))  # fmt: skip
        ray.get(worker.flush.remote())
        out["otel_tracking"] = ray.get(worker.otel_tracking_dir.remote())
    finally:
        ray.shutdown()
    return out


def child_span(spec: dict[str, Any]) -> dict[str, Any]:
    """The span path alone, in this process: a covered worker's annotated method called 2000 times
    in a row while its spans are held, then the held spans exported (the SDK alone: its
    ``BatchSpanProcessor`` with a long delay, then ``force_flush``), best of ``repeats``."""
    mode = spec["mode_name"]
    if mode in ("on", "before"):
        from otel_tracking.verl import install

        install("bench")
    worker = _annotated_worker()()
    flush: Any = lambda: None  # noqa: E731
    if mode == "sdk":
        provider = _sdk_provider(max_queue_size=100_000, schedule_delay_millis=1e9)
        worker.tracer = provider.get_tracer("bench")
        flush = provider.force_flush
    kwargs = {"_otel_context": spec["carrier"]} if mode in ("on", "before") else {}
    worker.update(-1, **kwargs)  # its worker run built
    if kwargs:
        from otel_tracking.distributed import drain
        from otel_tracking.runtime.run import current_run

        drain._become_covered(None)  # what the caller's first call does (drain.remember)
        run = current_run()
        assert run is not None
        for sink in run.all_sinks:
            if sink.queue is not None:
                sink.queue.hold_for(1e9)  # held until the flush, as the SDK's are
        flush = lambda: run.flush(60.0)  # noqa: E731
    flush()
    n, calls, exports = spec["n"], [], []
    for _ in range(spec["repeats"]):
        start = time.thread_time()
        for i in range(n):
            worker.update(i, **kwargs)
        calls.append(1e6 * (time.thread_time() - start) / n)
        start = _own_cpu()
        flush()
        exports.append(1e6 * (_own_cpu() - start) / n)
    import otel_tracking

    where = str(Path(otel_tracking.__file__).parents[1])  # the checkout this child ran
    return {"call_us": min(calls), "export_us": min(exports), "otel_tracking": where}


def part_span(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from tests.otlp_receiver import HttpReceiver

    modes = ("off", "sdk", *(("before",) if args.before else ()), "on")
    out: dict[str, Any] = {}
    for mode in modes:
        with HttpReceiver() as receiver:
            env = clean_env(OTEL_TRACKING_SPOOL_DIR=str(tmp / "spool"), RANK="0",
                            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)  # fmt: skip
            # this checkout's otel_tracking (or --before's), not one installed in the venv
            checkout = args.before if mode == "before" else str(REPO)
            env["PYTHONPATH"] = os.pathsep.join([checkout, env.get("PYTHONPATH", "")])
            spec = {"mode": "span", "mode_name": mode, "carrier": CARRIER, "n": 2000, "repeats": 7}
            out[mode] = child(spec, env, args.before if mode == "before" else None)
            out[mode]["spans_arrived"] = sum(s["name"] == "actor_update" for s in receiver.received.spans())
    return out


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def paced(call: Any, rate: float, seconds: float, cpu_s: Any, thread_s: Any = None) -> dict[str, Any]:
    """``call(i)`` ``rate`` times a second for ``seconds``: the worker's CPU seconds per wall second,
    and with ``thread_s`` the CPU µs per call of the thread the calls run on (the call's own work,
    apart from the export threads)."""
    start_wall, start_cpu = time.monotonic(), cpu_s()
    start_thread = thread_s() if thread_s is not None else 0.0
    i = 0
    while (now := time.monotonic()) < start_wall + seconds:
        due = start_wall + i / rate
        if now < due:
            time.sleep(due - now)
        call(i)
        i += 1
    wall = time.monotonic() - start_wall
    out = {"calls": i, "wall_s": wall, "cpu_per_wall_s": (cpu_s() - start_cpu) / wall}
    if thread_s is not None:
        out["call_thread_us_per_call"] = 1e6 * (thread_s() - start_thread) / i
    return out


def part_cpu(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from tests.otlp_receiver import HttpReceiver

    out: dict[str, Any] = {}
    before = ("before",) if args.before else ()  # the same worker with another checkout's otel_tracking
    cases = (("covered", "cpu_ray", ("off", "sdk", *before, "on")), ("uncovered", "cpu", ("off", "on")))
    for case, mode_name, modes in cases:
        env = clean_env(OTEL_TRACKING_SPOOL_DIR=str(tmp / "spool"), RANK="0")
        rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for _ in range(args.cpu_rounds):  # interleaved: the machine's load hits every mode alike
            for mode in modes:
                with HttpReceiver() as receiver:  # one each: the spans that arrived are that mode's
                    spec = {"mode": mode_name, "instrumented": mode in ("on", "before"), "sdk": mode == "sdk",
                            "carrier": CARRIER, "rate": args.rate, "seconds": args.cpu_seconds}  # fmt: skip
                    path = (
                        {"PYTHONPATH": os.pathsep.join([args.before, env.get("PYTHONPATH", "")])}
                        if mode == "before"
                        else {}
                    )
                    # Ray puts the driver's working directory first on its workers' path: that checkout's too
                    cwd = args.before if mode == "before" else None
                    one = child(spec, {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **path}, cwd)
                    one["spans_arrived"] = sum(s["name"] == "actor_update" for s in receiver.received.spans())
                    one["trace_requests"] = len(receiver.received.traces)
                rounds[mode].append(one)
        result: dict[str, Any] = {"rounds": rounds}
        for mode, each in rounds.items():  # the median round's CPU; the fewest calls and spans of any round
            result[mode] = {
                "cpu_per_wall_s": statistics.median(r["cpu_per_wall_s"] for r in each),
                "calls": min(r["calls"] for r in each),
                "spans_arrived": min(r["spans_arrived"] for r in each),
                "trace_requests": int(statistics.median(r["trace_requests"] for r in each)),
            }
            if "otel_tracking" in each[0]:
                result[mode]["otel_tracking"] = sorted({r["otel_tracking"] for r in each})
            if "call_thread_us_per_call" in each[0]:
                result[mode]["call_thread_us_per_call"] = statistics.median(r["call_thread_us_per_call"] for r in each)
        result["spans_arrived"] = result["on"]["spans_arrived"]
        result["trace_requests"] = result["on"]["trace_requests"]
        result["added_cpu_pct_of_a_core"] = 100 * (result["on"]["cpu_per_wall_s"] - result["off"]["cpu_per_wall_s"])
        if "sdk" in result:
            result["sdk_added_cpu_pct_of_a_core"] = 100 * (
                result["sdk"]["cpu_per_wall_s"] - result["off"]["cpu_per_wall_s"]
            )
            # what each adds to the same worker, side by side (not the totals: both hold Ray's own)
            result["on_over_sdk"] = result["added_cpu_pct_of_a_core"] / result["sdk_added_cpu_pct_of_a_core"]
        if "before" in result:
            result["before_added_cpu_pct_of_a_core"] = 100 * (
                result["before"]["cpu_per_wall_s"] - result["off"]["cpu_per_wall_s"]
            )
        out[case] = result
    return out


def render(report: dict[str, Any]) -> str:
    lines = [f"# bench_verl ({report['date']})", "", f"`{report['command']}`", ""]
    if "load_average" in report:
        load = ", ".join(f"{v:.2f}" for v in report["load_average"])
        lines += [f"Load average (1, 5, 15 min) at the start: {load}", ""]
    if "calls" in report:
        lines += ["## One worker-group call (RayWorkerGroup of 2, p50 of each round's p50)", "",
                  "| method | off p50 ms | on p50 ms | added ms | added % |", "|---|---|---|---|---|"]  # fmt: skip
        for method, s in report["calls"]["summary"].items():
            cells = (s["off_p50_ms"], s["on_p50_ms"], s["added_ms"])
            lines.append(f"| {method} | " + " | ".join(f"{v:.3f}" for v in cells) + f" | {s['added_pct']:.1f} |")
        lines.append("")
    if "micro" in report:
        m = report["micro"]
        lines += ["## The wrappers alone (µs per call, median of rounds)", "", "| | ours | verl's | added |",
                  "|---|---|---|---|"]  # fmt: skip
        for side in ("driver", "worker"):
            ours, theirs = m["per_call_us"][f"{side}_ours"], m["per_call_us"][f"{side}_verl"]
            lines.append(f"| {side} | {ours:.1f} | {theirs:.1f} | {ours - theirs:.1f} |")
        theirs = m["per_call_us"]["ray_verl"]
        for name, what in (("ray_other", "any other actor call"), ("ray_has_carrier", "a worker-group call"),
                           ("ray_adds_carrier", "an agent-loop / server call")):  # fmt: skip
            ours = m["per_call_us"][name]
            cells = f"{ours:.1f} | {theirs:.1f} | {ours - theirs:.1f}"
            lines.append(f"| `ActorHandle._actor_method_call`, {what} | {cells} |")
        lines.append("")
    if "span" in report:
        sp = report["span"]
        off = sp["off"]["call_us"]
        lines += ["## The span path alone, one process, covered (CPU µs, best of 7 repeats of 2000 calls)", "",
                  "| mode | call thread per call | added to the call | export, per span | added in all | "
                  "spans arrived |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for mode, one in sp.items():
            added = one["call_us"] - off
            lines.append(f"| {mode} | {one['call_us']:.1f} | {added:.1f} | {one['export_us']:.1f} | "
                         f"{added + one['export_us']:.1f} | {one['spans_arrived']} |")  # fmt: skip
        ran = ", ".join(f"{mode} {sp[mode]['otel_tracking']}" for mode in ("before", "on") if mode in sp)
        lines += ["", f"The checkouts the children imported: {ran}.", ""]
    if "import" in report:
        i = report["import"]["median_ms"]
        lines += [
            "## `python -c 'import verl'` (median ms)",
            "",
            "| on | off (plugin does nothing) | no plugins |",
            "|---|---|---|",
            f"| {i['on']:.0f} | {i['off']:.0f} | {i['no_plugins']:.0f} |",
            "",
        ]
    if "cpu" in report:
        rounds = len(report["cpu"]["covered"]["rounds"]["on"])
        lines += [f"## A worker at 200 DistProfiler spans/s (CPU s per wall s, median of {rounds} interleaved "
                  "rounds; % of a core)", "",
                  "| worker | off | plain SDK alone | ours | SDK added | ours added | ours added / SDK's | calls on | "
                  "spans arrived (SDK, ours) | OTLP requests (SDK, ours) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for case, what in (("covered", "a Ray actor its driver covers (returns at once)"),
                           ("uncovered", "nobody covers it (each call's end waits for its spans)")):  # fmt: skip
            c = report["cpu"][case]
            off, on = c["off"]["cpu_per_wall_s"], c["on"]["cpu_per_wall_s"]
            sdk = c.get("sdk")
            sdk_spans, sdk_requests = (sdk["spans_arrived"], sdk["trace_requests"]) if sdk else ("-", "-")
            cells = [f"{off:.3f}", f"{sdk['cpu_per_wall_s']:.3f}" if sdk else "-", f"{on:.3f}",
                     f"{c['sdk_added_cpu_pct_of_a_core']:.1f}%" if sdk else "-", f"{c['added_cpu_pct_of_a_core']:.1f}%",
                     f"{c['on_over_sdk']:.2f}x" if sdk else "-", str(c["on"]["calls"]),
                     f"{sdk_spans}, {c['spans_arrived']}", f"{sdk_requests}, {c['trace_requests']}"]  # fmt: skip
            lines.append(f"| {what} | " + " | ".join(cells) + " |")
        covered = report["cpu"]["covered"]
        if "before" in covered:
            b = covered["before"]
            ratio = covered["before_added_cpu_pct_of_a_core"] / covered["sdk_added_cpu_pct_of_a_core"]
            lines += ["", f"Before (`{report['before']}`, interleaved in the same rounds): "
                      f"ours {b['cpu_per_wall_s']:.3f}, "
                      f"added {covered['before_added_cpu_pct_of_a_core']:.1f}% ({ratio:.2f}x the SDK's), "
                      f"{b['spans_arrived']} spans arrived in {b['trace_requests']} OTLP requests; "
                      f"call thread {b.get('call_thread_us_per_call', 0):.0f} µs per call; the actor ran "
                      f"{', '.join(b['otel_tracking'])}, after's "
                      f"{', '.join(covered['on']['otel_tracking'])}."]  # fmt: skip
        if "call_thread_us_per_call" in covered["off"]:
            per_call = {mode: covered[mode]["call_thread_us_per_call"] for mode in ("off", "sdk", "on")}
            lines += ["", "The covered actor's call thread alone (CPU µs per call, median of rounds; the rest of the "
                      "CPU above is Ray's and the export threads'):", "",
                      "| off | plain SDK alone | ours | SDK added | ours added |", "|---|---|---|---|---|",
                      f"| {per_call['off']:.0f} | {per_call['sdk']:.0f} | {per_call['on']:.0f} | "
                      f"{per_call['sdk'] - per_call['off']:.0f} | "
                      f"{per_call['on'] - per_call['off']:.0f} |"]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="micro,import,cpu,calls,span")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved off/on rounds of the calls part")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--calls20", type=int, default=60)
    parser.add_argument("--micro-n", type=int, default=2000)
    parser.add_argument("--micro-rounds", type=int, default=7)
    parser.add_argument("--import-rounds", type=int, default=5)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--cpu-seconds", type=float, default=20.0)
    parser.add_argument("--cpu-rounds", type=int, default=1, help="interleaved rounds of the cpu part (median)")
    parser.add_argument(
        "--before", help="cpu and span parts: a checkout whose otel_tracking runs as one more mode (before/after)"
    )
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--label", default="verl", help="results file: bench/results/<UTC date>-<label>")
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        children = {"calls": child_calls, "micro": child_micro, "cpu": child_cpu, "cpu_ray": child_cpu_ray,
                    "span": child_span}  # fmt: skip
        print(json.dumps(children[spec["mode"]](spec)))
        return 0
    parts = {"micro": part_micro, "import": part_import, "cpu": part_cpu, "calls": part_calls, "span": part_span}
    report: dict[str, Any] = {
        "command": " ".join(["python", "bench/bench_verl.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_average": list(os.getloadavg()),
    }
    if args.before:
        report["before"] = args.before
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.parts.split(","):
            print(f"-- {name}", file=sys.stderr, flush=True)
            report[name] = parts[name](args, Path(tmp))
    text = render(report)
    print(text)
    if not args.no_save:
        report["load_average_after"] = list(os.getloadavg())
        out = REPO / "bench" / "results" / f"{report['date']}-{args.label}"
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
