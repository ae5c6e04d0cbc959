"""Worker processes: many processes opening ``trace_state`` spans into one local collector.

    python bench/bench_workers.py                          # default: 8 workers x 200 spans/s x 30 s
    python bench/bench_workers.py --workers 32 --seconds 60   # the issue's scale (needs the cores)
    python bench/bench_workers.py --parts scale,kill       # some parts only
    python bench/bench_workers.py --export-interval-ms 0,100  # the default delivery and a 100 ms export interval

What a process without ``Tracking`` does in distributed training (a verl worker on Ray): its first
``trace_state`` builds the process's worker run, which exports every span over OTLP/HTTP through our
queue/worker/retry/spool layer.  Every worker here is a real process (this file run with ``--child``),
configured as a Ray actor would be (``OTEL_EXPORTER_OTLP_ENDPOINT``, run identity in
``OTEL_RESOURCE_ATTRIBUTES``, the step's context in ``TRACEPARENT``/``BAGGAGE``), opening spans at a
fixed rate on a deadline schedule (span ``i`` is due at ``start + i / rate``; a late worker does not
sleep until it has caught up, so drift never accumulates).  The spans go to ONE real OpenTelemetry
Collector (the ``otelcol`` the stack builds, started here on free loopback ports with a small config
of its own: OTLP/HTTP -> batch -> debug at ``verbosity: basic``), whose own telemetry
(``otelcol_receiver_accepted_spans``, read from its Prometheus endpoint) counts what arrived.

Parts:

  scale  --workers processes x --rate spans/s for --seconds each; spans sent (what the workers
         counted), spans that arrived (the collector's counter), each worker's finish() stats.
  cost   an instrumented worker (one per export interval) beside a plain OTel SDK worker and an
         identical worker running the same paced loop without spans, all at the same time: CPU
         seconds per wall second (getrusage, all threads) and RSS.
  micro  one ``trace_state`` enter+exit beside a bare OTel SDK span (TracerProvider +
         BatchSpanProcessor(OTLPSpanExporter) to the same collector, ``start_as_current_span``) in one
         process, interleaved rounds: per-span p50/p99 and the ratio; plus CPU per span including the
         export, and a burst's throughput (spans/s until the collector has them).
  kill   a worker at --rate spans/s killed with SIGKILL after --kill-after s (what ``ray.kill`` does),
         --kills times; also SIGTERM (default disposition, and with a handler raising SystemExit) and a
         normal exit.  Each worker writes one byte per ended span on a pipe; lost = ended - arrived.

``--spans-per-call 1,10`` adds cost workers (100 ms export interval) whose spans come in calls of
that many, each call ending as a ``traced`` Ray method's does: :func:`otel_tracking.distributed.worker.deliver_pending`
waits until the call's spans have left (Ray may ``_exit`` the process once the caller has the
result); the time each call's end waits is reported too.

``--export-interval-ms`` compares the delivery's ``Policy.export_interval_s`` (at most one export
per interval for a busy sink; not yet a setting: the workers set it on their run).  Scale and kill
run once per interval; cost and micro put them side by side.

Results: bench/results/<UTC date>-<--save-as, default workers>.json and .md.  Every process started
here is stopped by its pid, also on errors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))

SPAN_NAME = "update_actor"
# The step's span the workers' spans hang under (what context_env() hands a subprocess).
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
BAGGAGE = "ml.project=bench,ml.experiment=workers,ml.run.id=bench-workers,ml.step=7"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# --- the collector -------------------------------------------------------------------------------

COLLECTOR_CONFIG = """\
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp_http}
processors:
  batch:
exporters:
  debug:
    verbosity: basic
service:
  telemetry:
    logs:
      level: warn
    metrics:
      level: detailed  # adds the HTTP server's request counts: exports per span
      readers:
        - pull:
            exporter:
              prometheus:
                host: 127.0.0.1
                port: {metrics}
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [debug]
    metrics:
      receivers: [otlp]
      processors: [batch]
      exporters: [debug]
    logs:
      receivers: [otlp]
      processors: [batch]
      exporters: [debug]
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Collector:
    """The real otelcol binary on free loopback ports, with a config of its own in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        from otel_tracking_stack.stack import build_collector

        self.binary = build_collector()  # the cached binary (built once by `otel-tracking stack build`)
        self.workdir = workdir
        self.otlp_http = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.otlp_http}"

    def start(self) -> Collector:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "collector.yaml"
        config.write_text(COLLECTOR_CONFIG.format(otlp_http=self.otlp_http, metrics=self.metrics_port))
        with (self.workdir / "collector.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "--config", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"otelcol exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                self.metrics()
                with socket.create_connection(("127.0.0.1", self.otlp_http), timeout=0.5):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"otelcol not ready after 30 s: {self.log_tail()}") from None
                time.sleep(0.1)

    def log_tail(self) -> str:
        path = self.workdir / "collector.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-20:]) if path.exists() else ""

    def metrics(self, labels: str = "") -> dict[str, float]:
        """The collector's own telemetry: every series (whose labels contain ``labels``) summed over
        its labels, ``_total`` dropped."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as response:
            text = response.read().decode()
        sums: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
            if match and labels in (match.group(2) or ""):
                name = match.group(1).removesuffix("_total")
                sums[name] = sums.get(name, 0.0) + float(match.group(3))
        return sums

    def trace_requests(self) -> int:
        """OTLP/HTTP trace export requests received (one per export call of a client)."""
        return int(self.metrics('http_route="/v1/traces"').get("http_server_request_duration_count", 0))

    def accepted(self) -> int:
        return int(self.metrics().get("otelcol_receiver_accepted_spans", 0))

    def refused(self) -> int:
        m = self.metrics()
        return int(m.get("otelcol_receiver_refused_spans", 0) + m.get("otelcol_receiver_failed_spans", 0))

    def cpu_s(self) -> float:
        return self.metrics().get("otelcol_process_cpu_seconds", 0.0)

    def settle(self, expect: int | None = None, quiet_s: float = 0.5, timeout_s: float = 30.0) -> int:
        """The accepted-spans counter once it reached ``expect``, or stopped moving for ``quiet_s``
        (no more than ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        last, since = self.accepted(), time.monotonic()
        while time.monotonic() < deadline:
            if expect is not None and last >= expect:
                return last
            time.sleep(0.05)
            now = self.accepted()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= (quiet_s if expect is None else max(quiet_s, 3.0)):
                return last
        return last

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen[Any] | None, timeout_s: float = 10.0) -> None:
    """Stop one process we started, by its pid: SIGTERM, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


# --- the worker processes (this file with --child) ----------------------------------------------


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    return usage.ru_utime + usage.ru_stime


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def use_export_interval(run: Any, interval_s: float) -> None:
    """The delivery option this bench compares (``Policy.export_interval_s``), on a built run's sinks."""
    import dataclasses

    for sink in run.all_sinks:
        if sink.queue is not None:
            sink.queue.policy = dataclasses.replace(sink.queue.policy, export_interval_s=interval_s)


def child_paced(spec: dict[str, Any]) -> None:
    """``rate`` spans/s for ``seconds`` (or until killed), on a deadline schedule.  ``kind``:
    ``trace_state`` (the worker run), ``sdk`` (a bare OTel SDK span, BatchSpanProcessor and the
    OTLP/HTTP exporter, as a plain OpenTelemetry worker would), or ``none`` (the identical loop
    without spans).  Results go to ``spec["out"]`` at exit, after the worker run was finished by
    its exit hook (so its finish() stats are final)."""
    if spec.get("sigterm_exits"):  # what an application (or the driver's run) installs: unwind on SIGTERM
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    import atexit

    from otel_tracking import trace_state
    from otel_tracking.distributed.worker import deliver_pending, worker_run

    kind = spec.get("kind", "trace_state")
    spans_per_call = spec.get("spans_per_call")  # a traced Ray call's end every that many spans
    call_ends: list[float] = []  # seconds each call's end waited for its spans to leave
    rate, seconds = spec["rate"], spec["seconds"]
    lane = f"rank_{spec.get('rank', 0)}"
    count_fd = spec.get("count_fd")
    warmup_s = spec.get("warmup_s", 2.0)
    period = 1.0 / rate
    result: dict[str, Any] = {"pid": os.getpid(), "kind": kind, "spans": 0}
    state: dict[str, Any] = {"end": None, "run": None}

    def report() -> None:  # atexit: after threading's exit hook finished the run (also after SIGTERM's SystemExit)
        end = state["end"] if state["end"] is not None else time.monotonic()
        result["finish_s"] = time.monotonic() - end
        result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        run = state["run"]
        if run is not None:
            result["stats"] = run.stats()
        Path(spec["out"]).write_text(json.dumps(result))

    atexit.register(report)
    if kind == "sdk":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource({"service.name": "bench-bare-sdk"}))  # flushed at exit
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        tracer = provider.get_tracer("bench")
    sdk_attributes = {"ml.lane": lane}
    result.update(rss_mb_before=_rss_mb(), cpu_before_s=_cpu_s())
    warm: tuple[float, float, int] | None = None  # (monotonic, cpu, spans) once warmup_s passed
    max_lag = steady_max_lag = 0.0
    late = 0
    i = 0
    start = time.monotonic()
    while True:
        due = start + i * period
        if due - start >= seconds:
            break
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        else:
            lag = now - due
            max_lag = max(max_lag, lag)
            if warm is not None:
                steady_max_lag = max(steady_max_lag, lag)
            late += lag > period
        if kind == "trace_state":
            with trace_state(SPAN_NAME, state_lane_id=lane):
                pass
        elif kind == "sdk":
            with tracer.start_as_current_span(SPAN_NAME, attributes=sdk_attributes):
                pass
        i += 1
        result["spans"] = i
        if spans_per_call and i % spans_per_call == 0:
            waited = time.perf_counter()
            deliver_pending()
            call_ends.append(time.perf_counter() - waited)
        if i == 1 and kind == "trace_state":
            state["run"] = worker_run()  # the run the first span built (the exit hook finishes it)
            if "export_interval_s" in spec:  # 0 too: worker runs default to OTEL_BSP_SCHEDULE_DELAY=100
                use_export_interval(state["run"], spec["export_interval_s"])
        if count_fd is not None:
            os.write(count_fd, b"\x01")  # this span has ended (unbuffered: the bench sees it now)
        if warm is None and time.monotonic() - start >= warmup_s:
            warm = (time.monotonic(), _cpu_s(), i)
    end, cpu_end = time.monotonic(), _cpu_s()
    wall = end - start
    result.update(
        wall_s=wall,
        rate=i / wall,
        max_lag_ms=max_lag * 1e3,
        steady_max_lag_ms=steady_max_lag * 1e3,
        late=late,
        cpu_per_wall=(cpu_end - result["cpu_before_s"]) / wall,
        rss_mb_end=_rss_mb(),
    )
    if warm is not None and end > warm[0]:
        result["steady_cpu_per_wall"] = (cpu_end - warm[1]) / (end - warm[0])
    if call_ends:
        result.update(
            calls=len(call_ends),
            call_end_p50_ms=percentile(call_ends, 50) * 1e3,
            call_end_p99_ms=percentile(call_ends, 99) * 1e3,
        )
    state["end"] = end


def child_micro(spec: dict[str, Any]) -> None:
    """``trace_state`` beside a bare SDK span, interleaved rounds of ``spans`` each."""
    import gc

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from otel_tracking import trace_state
    from otel_tracking.distributed.worker import worker_run

    provider = TracerProvider(resource=Resource({"service.name": "bench-bare-sdk"}), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # OTEL_EXPORTER_OTLP_ENDPOINT
    tracer = provider.get_tracer("bench")
    attributes = {"ml.lane": "rank_0"}
    with trace_state("warmup"):  # builds the worker run
        pass
    run = worker_run()
    assert run is not None
    with tracer.start_as_current_span("warmup"):
        pass
    clock = time.perf_counter_ns

    def ours(n: int) -> list[int]:
        out = []
        for _ in range(n):
            t = clock()
            with trace_state(SPAN_NAME, state_lane_id="rank_0"):
                pass
            out.append(clock() - t)
        return out

    def bare(n: int) -> list[int]:
        out = []
        for _ in range(n):
            t = clock()
            with tracer.start_as_current_span(SPAN_NAME, attributes=attributes):
                pass
            out.append(clock() - t)
        return out

    def ours_with(interval_s: float) -> Any:
        def timed(n: int) -> list[int]:
            use_export_interval(run, interval_s)
            return ours(n)

        return timed

    impls = {f"ours@{ms:g}": (ours_with(ms / 1e3), lambda: run.flush(30)) for ms in spec["intervals_ms"]}
    impls["sdk"] = (bare, lambda: provider.force_flush(30_000))
    samples: dict[str, list[int]] = {name: [] for name in impls}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in impls}
    n = spec["spans"]
    for r in range(spec["rounds"]):
        order = list(impls) if r % 2 == 0 else list(reversed(impls))  # interleaved, alternating order
        for name in order:
            timed, flush = impls[name]
            flush()
            gc.collect()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            times = timed(n)
            wall_spans = time.perf_counter() - wall0
            flush()  # until the exporter has handed every span of the round to the collector
            cpu1, wall1 = time.process_time(), time.perf_counter()
            samples[name] += times
            rounds[name].append(
                {
                    "p50_us": percentile(times, 50) / 1e3,
                    "p99_us": percentile(times, 99) / 1e3,
                    "cpu_us_per_span": (cpu1 - cpu0) / n * 1e6,  # the spans and their export (all threads)
                    "spans_per_s_exported": n / (wall1 - wall0),
                    "spans_per_s_opened": n / wall_spans,
                }
            )
    result: dict[str, Any] = {"spans_per_round": n, "rounds": spec["rounds"], "impls": {}}
    for name in impls:
        per_round = rounds[name]
        result["impls"][name] = {
            "p50_us": percentile(samples[name], 50) / 1e3,
            "p99_us": percentile(samples[name], 99) / 1e3,
            "round_p50_us": [r["p50_us"] for r in per_round],
            "round_p99_us": [r["p99_us"] for r in per_round],
            **{
                key: statistics.median(r[key] for r in per_round)
                for key in ("cpu_us_per_span", "spans_per_s_exported", "spans_per_s_opened")
            },
        }
    result["stats"] = run.finish()
    provider.shutdown()
    Path(spec["out"]).write_text(json.dumps(result))


# --- the parts ----------------------------------------------------------------------------------


class Workers:
    """Every child process of the bench, stopped by pid in ``close()`` (also on errors)."""

    def __init__(self, root: Path, collector: Collector) -> None:
        self.root = root
        self.collector = collector
        self.procs: list[subprocess.Popen[bytes]] = []
        self.serial = 0

    def env(self, rank: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEPARENT", "BAGGAGE"))}
        env.update(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": self.collector.endpoint,
                "OTEL_TRACKING_SPOOL_DIR": str(self.root / "spool"),
                "OTEL_TRACKING_RUN_ID": "bench-workers",
                "OTEL_RESOURCE_ATTRIBUTES": "ml.project=bench,ml.experiment=workers,ml.run.id=bench-workers",
                "OTEL_TRACKING_ROLE": "ActorWorker",
                "RANK": str(rank),
                "TRACEPARENT": TRACEPARENT,
                "BAGGAGE": BAGGAGE,
                "PYTHONPATH": str(REPO),
            }
        )
        return env

    def start(self, spec: dict[str, Any], pass_fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen[bytes], Path]:
        self.serial += 1
        out = self.root / f"child-{self.serial}.json"
        spec = {**spec, "out": str(out)}
        log = (self.root / f"child-{self.serial}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
            env=self.env(spec.get("rank", 0)),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=pass_fds,
        )
        log.close()
        self.procs.append(proc)
        return proc, out

    def wait(self, proc: subprocess.Popen[bytes], out: Path, timeout_s: float) -> dict[str, Any]:
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop_process(proc)
            raise RuntimeError(f"child {proc.pid} did not finish in {timeout_s:.0f} s") from None
        if code != 0 or not out.exists():
            log = out.with_suffix(".log")
            raise RuntimeError(f"child {proc.pid} exited with {code}: {log.read_text(errors='replace')[-2000:]}")
        return json.loads(out.read_text())

    def close(self) -> None:
        for proc in self.procs:
            stop_process(proc)


def part_scale(workers: Workers, args: argparse.Namespace, interval_ms: float) -> dict[str, Any]:
    collector = workers.collector
    before, cpu_before, requests_before = collector.settle(), collector.cpu_s(), collector.trace_requests()
    started = time.monotonic()
    common = {"mode": "paced", "rate": args.rate, "seconds": args.seconds, "export_interval_s": interval_ms / 1e3}
    children = [workers.start({**common, "rank": rank}) for rank in range(args.workers)]
    results = [workers.wait(proc, out, args.seconds + 120) for proc, out in children]
    wall = time.monotonic() - started
    sent = sum(r["spans"] for r in results)
    arrived = collector.settle(before + sent) - before
    totals = {k: sum(r["stats"]["otlp-traces"][k] for r in results) for k in results[0]["stats"]["otlp-traces"]}
    return {
        "workers": args.workers,
        "rate": args.rate,
        "seconds": args.seconds,
        "export_interval_ms": interval_ms,
        "sent": sent,
        "arrived": arrived,
        "refused": collector.refused(),
        "export_requests": collector.trace_requests() - requests_before,
        "totals": totals,
        "collector_cpu_per_wall": (collector.cpu_s() - cpu_before) / wall,
        "per_worker": [
            {
                "spans": r["spans"],
                "rate": r["rate"],
                "max_lag_ms": r["max_lag_ms"],
                "steady_max_lag_ms": r["steady_max_lag_ms"],
                "late": r["late"],
                "cpu_per_wall": r["cpu_per_wall"],
                "steady_cpu_per_wall": r.get("steady_cpu_per_wall"),
                "finish_s": r["finish_s"],
                **r["stats"]["otlp-traces"],
            }
            for r in results
        ],
    }


def cost_kinds(intervals_ms: list[float], spans_per_call: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
    kinds = {f"trace_state@{ms:g}": {"kind": "trace_state", "export_interval_s": ms / 1e3} for ms in intervals_ms}
    calls = {
        f"calls@{n}": {"kind": "trace_state", "export_interval_s": CALLS_EXPORT_INTERVAL_S, "spans_per_call": n}
        for n in spans_per_call
    }
    return {**kinds, **calls, "sdk": {"kind": "sdk"}, "bare": {"kind": "none"}}


CALLS_EXPORT_INTERVAL_S = 0.1  # a worker run's default (distributed/environment.py WORKER_EXPORT_INTERVAL_S)


def part_cost(workers: Workers, args: argparse.Namespace) -> dict[str, Any]:
    """Instrumented workers (one per export interval), a plain-SDK one and a bare one, side by side,
    --cost-rounds times."""
    kinds = cost_kinds(args.intervals, args.calls)
    rounds = []
    for _ in range(args.cost_rounds):
        common = {"mode": "paced", "rate": args.rate, "seconds": args.cost_seconds}
        children = {name: workers.start({**common, **kind}) for name, kind in kinds.items()}
        rounds.append(
            {name: workers.wait(proc, out, args.cost_seconds + 120) for name, (proc, out) in children.items()}
        )
    out: dict[str, Any] = {"rate": args.rate, "seconds": args.cost_seconds, "rounds": len(rounds), "workers": {}}
    keys = ("cpu_per_wall", "steady_cpu_per_wall", "rss_mb_before", "rss_mb_end", "max_rss_mb", "rate")
    bare = None
    for name in reversed(kinds):  # "bare" first: the others are measured against it
        runs = [r[name] for r in rounds]
        x = {key: statistics.median(r[key] for r in runs) for key in keys}
        x["rss_growth_mb"] = statistics.median(r["rss_mb_end"] - r["rss_mb_before"] for r in runs)
        if "calls" in runs[0]:
            for key in ("calls", "call_end_p50_ms", "call_end_p99_ms"):
                x[key] = statistics.median(r[key] for r in runs)
        if bare is None:
            bare = x
        else:
            x["over_bare"] = {
                "steady_cpu_per_wall": x["steady_cpu_per_wall"] - bare["steady_cpu_per_wall"],
                "cpu_per_wall": x["cpu_per_wall"] - bare["cpu_per_wall"],
                "max_rss_mb": x["max_rss_mb"] - bare["max_rss_mb"],
            }
        out["workers"][name] = x
    out["workers"] = dict(reversed(out["workers"].items()))
    return out


def part_micro(workers: Workers, args: argparse.Namespace) -> dict[str, Any]:
    spec = {"mode": "micro", "rounds": args.micro_rounds, "spans": args.micro_spans, "intervals_ms": args.intervals}
    proc, out = workers.start(spec)
    result = workers.wait(proc, out, 600)
    sdk = result["impls"]["sdk"]

    def per_round(x: dict[str, Any], key: str) -> float:
        """The median over rounds of this round's ratio: each round ran both back to back, so a
        machine that gets busier or quieter during the run moves both sides alike."""
        return statistics.median(a / b for a, b in zip(x[key], sdk[key], strict=True))

    result["ratio"] = {
        name: {
            "p50": x["p50_us"] / sdk["p50_us"],
            "p99": x["p99_us"] / sdk["p99_us"],
            "p50_per_round": per_round(x, "round_p50_us"),
            "p99_per_round": per_round(x, "round_p99_us"),
            "cpu_per_span": x["cpu_us_per_span"] / sdk["cpu_us_per_span"],
        }
        for name, x in result["impls"].items()
        if name != "sdk"
    }
    return result


def _count_bytes(fd: int, into: list[int]) -> None:
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        into[0] += len(chunk)


def one_ending(workers: Workers, args: argparse.Namespace, how: str, interval_ms: float) -> dict[str, Any]:
    """A worker at --rate spans/s ended by ``how`` (SIGKILL, SIGTERM, SIGTERM with a handler that
    raises SystemExit, or a normal exit) after --kill-after s; ended (from its pipe) vs. arrived."""
    collector = workers.collector
    before = collector.settle()
    read_fd, write_fd = os.pipe()
    ended = [0]
    spec: dict[str, Any] = {
        "mode": "paced",
        "rate": args.rate,
        "count_fd": write_fd,
        "export_interval_s": interval_ms / 1e3,
    }
    after = args.kill_after + random.uniform(0, 0.1)  # not phase-locked to the span schedule
    spec["seconds"] = after if how == "exit" else 3600
    spec["sigterm_exits"] = how == "SIGTERM+handler"
    try:
        proc, out = workers.start(spec, pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    reader = threading.Thread(target=_count_bytes, args=(read_fd, ended), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while ended[0] == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)  # until its first span ended (the process has started and built its run)
        first = time.monotonic()
        if how == "exit":
            code = proc.wait(after + 60)
        else:
            time.sleep(max(0.0, after - (time.monotonic() - first)))
            os.kill(proc.pid, signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
            code = proc.wait(60)
        reader.join(10)
    finally:
        stop_process(proc)
        os.close(read_fd)
    flushed = how in ("exit", "SIGTERM+handler")  # the run was finished: everything should arrive
    arrived = collector.settle(before + ended[0] if flushed else None) - before
    stats = json.loads(out.read_text()).get("stats", {}).get("otlp-traces") if out.exists() else None
    return {
        "how": how,
        "exit_code": code,
        "ended": ended[0],
        "arrived": arrived,
        "lost": ended[0] - arrived,
        "stats": stats,
    }


def part_kill(workers: Workers, args: argparse.Namespace, interval_ms: float) -> dict[str, Any]:
    plan = [("SIGKILL", args.kills), ("SIGTERM", args.terms), ("SIGTERM+handler", args.terms), ("exit", args.exits)]
    out: dict[str, Any] = {
        "rate": args.rate,
        "kill_after_s": args.kill_after,
        "export_interval_ms": interval_ms,
        "cases": {},
    }
    for how, times in plan:
        if not times:
            continue
        runs = [one_ending(workers, args, how, interval_ms) for _ in range(times)]
        lost = [r["lost"] for r in runs]
        out["cases"][how] = {
            "runs": runs,
            "n": len(runs),
            "ended": sum(r["ended"] for r in runs),
            "arrived": sum(r["arrived"] for r in runs),
            "lost_mean": statistics.mean(lost),
            "lost_median": statistics.median(lost),
            "lost_max": max(lost),
            "lost_min": min(lost),
            "lost_ms_mean": statistics.mean(lost) / args.rate * 1e3,
            "lost_ms_max": max(lost) / args.rate * 1e3,
        }
    return out


# --- report -------------------------------------------------------------------------------------


def machine(collector: Collector | None) -> dict[str, Any]:
    from bench.bench_log import machine as base

    info = {k: v for k, v in base().items() if k in ("python", "platform", "cpus", "cpu", "opentelemetry-sdk")}
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["opentelemetry-exporter-otlp-proto-http"] = version("opentelemetry-exporter-otlp-proto-http")
    with contextlib.suppress(Exception):
        info["loadavg_at_start"] = os.getloadavg()
    if collector is not None:
        with contextlib.suppress(Exception):
            info["otelcol"] = subprocess.run(
                [str(collector.binary), "--version"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
    return info


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _interval(ms: float) -> str:
    return "each span at once (default)" if not ms else f"export_interval {ms:g} ms"


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# Worker processes: trace_state spans into one local collector",
        "",
        f"machine: {m.get('cpu', '?')}, {m['cpus']} cpus, Python {m['python']}, "
        f"opentelemetry-sdk {m.get('opentelemetry-sdk', '?')}, {m.get('otelcol', 'otelcol')}; "
        f"load average at start {', '.join(f'{x:.1f}' for x in m.get('loadavg_at_start', ()))}",
        f"command: `{report['command']}`",
    ]
    parts = report["parts"]
    if parts.get("scale"):
        runs = list(parts["scale"].values())
        s0 = runs[0]
        lines += [
            "",
            f"## Scale: {s0['workers']} workers x {s0['rate']:g} spans/s x {s0['seconds']:g} s, one collector",
            "",
            "| measure | " + " | ".join(_interval(s["export_interval_ms"]) for s in runs) + " |",
            "|---|" + "---|" * len(runs),
        ]

        def row(label: str, cell: Any) -> None:
            lines.append(f"| {label} | " + " | ".join(cell(s, s["per_worker"], s["totals"]) for s in runs) + " |")

        row("spans sent (counted by the workers)", lambda s, w, t: str(s["sent"]))
        row("spans arrived (collector's accepted-spans counter)", lambda s, w, t: str(s["arrived"]))
        row("**lost**", lambda s, w, t: f"**{s['sent'] - s['arrived']}**")
        row("refused or failed at the collector", lambda s, w, t: str(s["refused"]))
        row(
            "finish() stats, all workers: delivered / spooled / dropped",
            lambda s, w, t: f"{t['delivered']} / {t['spooled']} / {t['dropped']}",
        )
        row("failed / retried export attempts", lambda s, w, t: f"{t['failed']} / {t['retried']}")
        row(
            "OTLP export requests (spans per request)",
            lambda s, w, t: f"{s['export_requests']} ({s['sent'] / max(1, s['export_requests']):.1f})",
        )
        row(
            "achieved spans/s per worker (min-max)",
            lambda s, w, t: f"{min(x['rate'] for x in w):.1f}-{max(x['rate'] for x in w):.1f}",
        )
        row(
            "schedule lag, worst worker: whole run / after its first 2 s (ms)",
            lambda s, w, t: f"{max(x['max_lag_ms'] for x in w):.0f} / {max(x['steady_max_lag_ms'] for x in w):.0f}",
        )
        row(
            "worker CPU / wall, median (min-max)",
            lambda s, w, t: (
                f"{_pct(statistics.median(x['cpu_per_wall'] for x in w))} "
                f"({_pct(min(x['cpu_per_wall'] for x in w))}-{_pct(max(x['cpu_per_wall'] for x in w))})"
            ),
        )
        row("collector CPU / wall", lambda s, w, t: _pct(s["collector_cpu_per_wall"]))
        row("worker finish() at exit, max (s)", lambda s, w, t: f"{max(x['finish_s'] for x in w):.2f}")
        for s in runs:
            lines.append(
                f"\nper worker, {_interval(s['export_interval_ms'])} (delivered/spooled/dropped): "
                + ", ".join(f"{x['delivered']}/{x['spooled']}/{x['dropped']}" for x in s["per_worker"])
            )
    if "cost" in parts:
        c = parts["cost"]
        lines += [
            "",
            f"## Cost per worker at {c['rate']:g} spans/s ({c['seconds']:g} s, {c['rounds']} round(s), "
            "all side by side)",
            "",
            "| worker | CPU / wall, steady | over bare | CPU / wall, whole run | RSS before first span MB |"
            " RSS at end MB | RSS growth MB | max RSS MB | max RSS over bare MB |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key, r in c["workers"].items():
            if key.startswith("trace_state@"):
                name = f"trace_state, {_interval(float(key.split('@')[1]))}"
            elif key.startswith("calls@"):
                name = (
                    f"trace_state, export_interval {CALLS_EXPORT_INTERVAL_S * 1e3:g} ms, a call's end every "
                    f"{key.split('@')[1]} span(s), waiting p50 {r['call_end_p50_ms']:.2f} / p99 "
                    f"{r['call_end_p99_ms']:.2f} ms"
                )
            else:
                name = {"sdk": "plain OTel SDK span + BatchSpanProcessor", "bare": "bare (same loop, no spans)"}[key]
            over = r.get("over_bare")
            cpu_over = f"**{_pct(over['steady_cpu_per_wall'])}**" if over else ""
            rss_over = f"{over['max_rss_mb']:+.1f}" if over else ""
            lines.append(
                f"| {name} | {_pct(r['steady_cpu_per_wall'])} | {cpu_over} | {_pct(r['cpu_per_wall'])} | "
                f"{r['rss_mb_before']:.1f} | {r['rss_mb_end']:.1f} | {r['rss_growth_mb']:+.1f} | "
                f"{r['max_rss_mb']:.1f} | {rss_over} |"
            )
    if "micro" in parts:
        mi = parts["micro"]
        lines += [
            "",
            f"## One span: trace_state vs. a bare OTel SDK span "
            f"({mi['rounds']} interleaved rounds x {mi['spans_per_round']} spans, one process)",
            "",
            "| impl | p50 us | p99 us | CPU us per span incl. export | spans/s opened | spans/s until exported |"
            " p50 / SDK (median of rounds) | p99 / SDK (median of rounds) | CPU / SDK |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, x in mi["impls"].items():
            label = "SDK span + BatchSpanProcessor" if name == "sdk" else f"trace_state, {_interval(float(name[5:]))}"
            r = mi["ratio"].get(name)
            ratios = (
                f"**{r['p50']:.2f}x** ({r['p50_per_round']:.2f}x) | **{r['p99']:.2f}x** ({r['p99_per_round']:.2f}x) | "
                f"{r['cpu_per_span']:.2f}x"
                if r
                else " | | "
            )
            lines.append(
                f"| {label} | {x['p50_us']:.1f} | {x['p99_us']:.1f} | {x['cpu_us_per_span']:.1f} | "
                f"{x['spans_per_s_opened']:.0f} | {x['spans_per_s_exported']:.0f} | {ratios} |"
            )
    if parts.get("kill"):
        kills = list(parts["kill"].values())
        k0 = kills[0]
        lines += [
            "",
            f"## What an ended worker loses ({k0['rate']:g} spans/s, ended after ~{k0['kill_after_s']:g} s)",
            "",
            "| delivery | how | runs | spans ended | arrived | lost per run: mean (min-max) |"
            " lost, ms of spans: mean (max) |",
            "|---|---|---|---|---|---|---|",
        ]
        for k in kills:
            for how, x in k["cases"].items():
                lines.append(
                    f"| {_interval(k['export_interval_ms'])} | {how} | {x['n']} | {x['ended']} | {x['arrived']} | "
                    f"{x['lost_mean']:.1f} ({x['lost_min']}-{x['lost_max']}) | "
                    f"{x['lost_ms_mean']:.1f} ({x['lost_ms_max']:.0f}) |"
                )
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="scale,cost,micro,kill")
    parser.add_argument("--workers", type=int, default=8, help="worker processes in the scale part")
    parser.add_argument("--rate", type=float, default=200.0, help="spans per second per worker")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each scale worker runs")
    parser.add_argument(
        "--export-interval-ms",
        default="0",
        help="comma list: the delivery's export_interval (0 = the default, each span at once); "
        "scale, kill are run for each, cost and micro compare them side by side",
    )
    parser.add_argument(
        "--spans-per-call",
        default="",
        help="comma list: cost workers whose spans come in traced calls of this many, each call's end "
        "waiting until its spans left (deliver_pending)",
    )
    parser.add_argument("--cost-seconds", type=float, default=20.0)
    parser.add_argument("--cost-rounds", type=int, default=1)
    parser.add_argument("--micro-rounds", type=int, default=10)
    parser.add_argument("--micro-spans", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLed workers")
    parser.add_argument("--terms", type=int, default=3, help="SIGTERMed workers (each way)")
    parser.add_argument("--exits", type=int, default=3, help="workers that exit normally")
    parser.add_argument("--kill-after", type=float, default=2.0, help="seconds of spans before the signal")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--save-as", default="workers", help="results: bench/results/<UTC date>-<this>.json/.md")
    parser.add_argument("--render", type=Path, help="print the tables of a saved results JSON and exit")
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        {"paced": child_paced, "micro": child_micro}[spec["mode"]](spec)
        return 0
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    args.intervals = [float(x) for x in args.export_interval_ms.split(",")]
    args.calls = [int(x) for x in args.spans_per_call.split(",") if x]

    def per_interval(part: Any) -> Any:
        return lambda w, a: {f"{ms:g}": part(w, a, ms) for ms in a.intervals}

    parts = {"scale": per_interval(part_scale), "cost": part_cost, "micro": part_micro, "kill": per_interval(part_kill)}
    report: dict[str, Any] = {
        "command": " ".join(["python", "bench/bench_workers.py", *sys.argv[1:]]),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "parts": {},
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        collector = Collector(Path(tmp) / "collector")
        report["machine"] = machine(collector)
        workers = Workers(Path(tmp), collector)
        try:
            collector.start()
            for name in args.parts.split(","):
                t0 = time.monotonic()
                report["parts"][name] = parts[name](workers, args)
                report.setdefault("took_s_by_part", {})[name] = time.monotonic() - t0
                print(render({**report, "parts": {name: report["parts"][name]}}), file=sys.stderr, flush=True)
        finally:
            workers.close()
            collector.stop()
    report["took_s"] = time.monotonic() - started
    text = render(report) + f"\n\nwhole run: {report['took_s']:.0f} s"
    print(text)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d", time.gmtime())
        (RESULTS / f"{stamp}-{args.save_as}.json").write_text(json.dumps(report, indent=2) + "\n")
        (RESULTS / f"{stamp}-{args.save_as}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
