"""N simulated ranks on 2 cores: what the driver pays per step, what each rank pays, and whether
every span and stall record arrives, through the stack's real agent and gateway.

    python bench/bench_scale.py --sizes 16,64                  # while building (about 2 minutes)
    python bench/bench_scale.py --sizes 16,64,256,1024 --label scale   # the sweep
    python bench/bench_scale.py --sizes 0 --max-rate           # only the gateway's top rate

Per N (fresh collectors each time): a receiver, a downstream collector, the gateway
(``scale_collectors.py``), one agent; the driver (``scale_driver.py``); ``ceil(N / --ranks-per-host)``
host processes holding the ranks (``scale_ranks.py``, one worker run per rank).  The driver runs
one warm-up step, ``--steps`` measured steps of ``--step-s`` seconds, then one step in which one
rank never returns from ``update_actor`` until the driver's stall record has named it.  Every
bound is ``OTEL_TRACKING_STALL_AFTER=--bound-s`` (default 1.5 steps, so that no normal phase
reaches it).  Then every run finishes, and the counts are read: each process's own (spans ended,
stall records emitted, its sinks' delivered/spooled/dropped), each collector's own telemetry, and
the receiver's.

``--max-rate``: the gateway alone (fresh, both trace exporters to the downstream collector),
offered OTLP/HTTP requests of 512 spans at rising rates for 5 s each; the top rate it accepted
in full, without a refusal or a drop at an exporter.

Results: bench/results/<UTC date>-<label>.json, .md and .png (each cost against N).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import scale_collectors as collectors  # noqa: E402


def percentile(samples: Sequence[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def child_env(workdir: Path, agent_http: str, run_id: str, bound_s: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env.update(
        PYTHONPATH=str(REPO),
        OTEL_EXPORTER_OTLP_ENDPOINT=agent_http,
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_TRACKING_RUN_ID=run_id,
        OTEL_TRACKING_STALL_AFTER=str(bound_s),
        OTEL_TRACKING_SPOOL_DIR=str(workdir / "spool"),
    )
    return env


def one_size(args: argparse.Namespace, world: int, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    receiver = collectors.Receiver().start()
    procs: list[subprocess.Popen[bytes]] = []
    started: list[Any] = []
    try:
        down, _, down_http = collectors.downstream(workdir)
        started.append(down)
        gw, gw_grpc, _ = collectors.gateway(workdir, receiver.endpoint, f"http://127.0.0.1:{down_http}", True)
        started.append(gw)
        agent = collectors.agent(workdir, gw_grpc)
        started.append(agent)
        run_id = f"scale-{world}-{uuid.uuid4().hex[:8]}"
        env = child_env(workdir, agent.otlp_http_endpoint, run_id, args.bound_s)
        hosts = max(1, math.ceil(world / args.ranks_per_host))
        port = collectors.free_port()
        stuck_rank = (world * 2) // 3 + 1 if world > 1 else 0
        driver_cmd = [
            sys.executable,
            str(REPO / "bench" / "scale_driver.py"),
            "--listen",
            str(port),
            "--hosts",
            str(hosts),
            "--world",
            str(world),
            "--steps",
            str(args.steps),
            "--step-s",
            str(args.step_s),
            "--stuck-rank",
            str(stuck_rank),
            "--bound-s",
            str(args.bound_s),
            "--ranks-per-node",
            str(args.ranks_per_node),
        ]
        driver_env = {**env, "OTEL_SERVICE_NAME": "verl-driver", "OTEL_TRACKING_ROLE": "driver"}
        with (workdir / "driver.err").open("wb") as err:  # the child holds its own copy
            driver = subprocess.Popen(driver_cmd, env=driver_env, cwd=workdir, stdout=subprocess.PIPE, stderr=err)
        procs.append(driver)
        host_env = {**env, "OTEL_SERVICE_NAME": "verl-worker", "OTEL_METRICS_EXPORTER": "none"}
        per_host = math.ceil(world / hosts)
        for index in range(hosts):
            first = index * per_host
            count = min(per_host, world - first)
            cmd = [
                sys.executable,
                str(REPO / "bench" / "scale_ranks.py"),
                "--driver",
                f"127.0.0.1:{port}",
                "--host-index",
                str(index),
                "--ranks",
                f"{first}:{count}",
                "--step-s",
                str(args.step_s),
                "--ranks-per-node",
                str(args.ranks_per_node),
            ]
            with (workdir / f"host-{index}.err").open("wb") as err:
                procs.append(subprocess.Popen(cmd, env=host_env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=err))
        peaks = {"agent": 0, "gateway": 0}
        cpu0 = {"agent": collectors.cpu_s(agent.pid), "gateway": collectors.cpu_s(gw.pid)}
        done = threading.Event()

        def sample() -> None:  # the collectors' peak RSS while the job runs (VmHWM says the same at the end)
            while not done.wait(1.0):
                for name, pid in (("agent", agent.pid), ("gateway", gw.pid)):
                    peaks[name] = max(peaks[name], collectors.memory_kb(pid).get("VmRSS", 0))

        threading.Thread(target=sample, daemon=True).start()
        out, _ = driver.communicate(timeout=args.steps * args.step_s * 3 + 600)
        if driver.returncode != 0:
            raise RuntimeError(f"driver failed ({driver.returncode}): {(workdir / 'driver.err').read_text()[-3000:]}")
        result = json.loads(out.decode().strip().splitlines()[-1])
        for proc in procs[1:]:
            proc.wait(120)
        emitted_rank = sum(h["spans"] for h in result["host_stats"].values())
        emitted = emitted_rank + result["driver_spans"]
        # everything left the processes; wait until it has passed both collectors
        deadline = time.monotonic() + 60
        while receiver.spans < emitted and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # a late stall record, a second export of the same span: counted if any
        done.set()
        result["collectors"] = {
            "agent": {
                **agent.self_metrics(),
                "memory_kb": collectors.memory_kb(agent.pid),
                "peak_rss_kb": peaks["agent"],
                "cpu_s": collectors.cpu_s(agent.pid) - cpu0["agent"],
            },
            "gateway": {
                **gw.counts(),
                "memory_kb": collectors.memory_kb(gw.pid),
                "peak_rss_kb": peaks["gateway"],
                "cpu_s": collectors.cpu_s(gw.pid) - cpu0["gateway"],
            },
            "downstream": down.counts(),
        }
        result["receiver"] = {
            "spans": receiver.spans,
            "rank_spans": receiver.rank_spans,
            "log_records": receiver.log_records,
            "stalls": receiver.stalls,
            "lag_p50_s": percentile(receiver.lags_ns, 50) / 1e9,
            "lag_p99_s": percentile(receiver.lags_ns, 99) / 1e9,
            "lag_min_s": min(receiver.lags_ns, default=0) / 1e9,
        }
        expected = world * result["rank_spans_per_step"] + 7
        result["whole_trace_s"] = []
        for ended in result["ended"]:
            at = receiver.whole_trace_ns(ended["trace_id"], expected)
            result["whole_trace_s"].append(None if at is None else (at - ended["end_ns"]) / 1e9)
        result["emitted_spans"] = emitted
        return result
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for col in reversed(started):
            col.stop()
        receiver.stop()


def returns_watcher(sizes: list[int]) -> list[dict[str, Any]]:
    """verl/returns.py's watcher thread alone per N (scale_driver.py --returns-watcher)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "scale_driver.py"), "--returns-watcher", ",".join(map(str, sizes))],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# --- the gateway's top rate ------------------------------------------------------------------------


def span_request(spans: int) -> bytes:
    """One OTLP/HTTP request of ``spans`` spans shaped as a rank's (resource, names, attributes)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    def kv(key: str, value: Any) -> KeyValue:
        return KeyValue(
            key=key, value=AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
        )

    now = time.time_ns()
    request = ExportTraceServiceRequest()
    for rank in range(8):  # one request holds a few ranks' spans, as the agent batches them
        rs = ResourceSpans()
        rs.resource.attributes.extend(
            [
                kv("service.name", "verl-worker"),
                kv("ml.rank", rank),
                kv("ml.role", "actor"),
                kv("host.name", "node-0000"),
                kv("ml.run.id", "max-rate"),
            ]
        )
        ss = ScopeSpans()
        for i in range(spans // 8):
            ss.spans.append(
                Span(
                    trace_id=os.urandom(16),
                    span_id=os.urandom(8),
                    name=f"phase_{i % 20}",
                    kind=Span.SPAN_KIND_INTERNAL,
                    start_time_unix_nano=now,
                    end_time_unix_nano=now + 1_000_000,
                    attributes=[kv("ml.step", 7), kv("ml.lane", str(rank))],
                )
            )
        rs.scope_spans.append(ss)
        request.resource_spans.append(rs)
    return request.SerializeToString()


def max_rate(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import requests

    workdir.mkdir(parents=True, exist_ok=True)
    started: list[Any] = []
    levels = []
    try:
        down, down_grpc, down_http = collectors.downstream(workdir)
        started.append(down)
        gw, _, gw_http = collectors.gateway(workdir, f"127.0.0.1:{down_grpc}", f"http://127.0.0.1:{down_http}", False)
        started.append(gw)
        body = span_request(512)
        url = f"http://127.0.0.1:{gw_http}/v1/traces"
        for rate in args.rates:
            before = gw.counts()
            cpu0 = collectors.cpu_s(gw.pid)
            requests_per_s = rate / 512
            sent = [0, 0]  # requests answered 2xx, other
            stop_at = time.monotonic() + args.rate_seconds
            lock = threading.Lock()

            def post(
                offset: float, every: float, stop_at: float = stop_at, sent: list[int] = sent, lock: Any = lock
            ) -> None:
                session = requests.Session()
                due = time.monotonic() + offset
                while due < stop_at:
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    try:
                        ok = session.post(
                            url, data=body, headers={"Content-Type": "application/x-protobuf"}, timeout=10
                        ).ok
                    except requests.RequestException:
                        ok = False
                    with lock:
                        sent[0 if ok else 1] += 1
                    due += every

            threads = 4
            every = threads / requests_per_s
            workers = [threading.Thread(target=post, args=(i * every / threads, every)) for i in range(threads)]
            t0 = time.monotonic()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            took = time.monotonic() - t0
            time.sleep(3)  # the gateway's batch (1 s) and exporters drain
            after = gw.counts()
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            level = {
                "offered_spans_per_s": rate,
                "achieved_spans_per_s": sent[0] * 512 / took,
                "requests_ok": sent[0],
                "requests_failed": sent[1],
                "accepted": delta.get("otelcol_receiver_accepted_spans", 0),
                "refused": delta.get("otelcol_receiver_refused_spans", 0)
                + delta.get("otelcol_receiver_failed_spans", 0),
                "exporter_sent": delta.get("otelcol_exporter_sent_spans", 0),
                "exporter_send_failed": delta.get("otelcol_exporter_send_failed_spans", 0),
                "exporter_enqueue_failed": delta.get("otelcol_exporter_enqueue_failed_spans", 0),
                "gateway_cpu_per_s": (collectors.cpu_s(gw.pid) - cpu0) / took,
                "gateway_rss_kb": collectors.memory_kb(gw.pid).get("VmRSS", 0),
            }
            level["clean"] = (
                level["refused"] == 0
                and level["requests_failed"] == 0
                and level["exporter_send_failed"] == 0
                and level["exporter_enqueue_failed"] == 0
                and level["achieved_spans_per_s"] >= 0.95 * rate
            )
            levels.append(level)
            print(f"max-rate {rate}: {json.dumps(level)}", flush=True)
            if not level["clean"]:
                break
    finally:
        for col in reversed(started):
            col.stop()
    clean = [lv["achieved_spans_per_s"] for lv in levels if lv["clean"]]
    return {"levels": levels, "top_clean_spans_per_s": max(clean, default=0.0)}


# --- the report ------------------------------------------------------------------------------------


def summarize(result: dict[str, Any], step_s: float) -> dict[str, Any]:
    measured = [s for s in result["steps"] if s["measured"]]
    by_step = {e["step"]: e for e in result["ended"]}
    # a step's end: its log(), then (at the next step's first phase) its root's end and anatomy
    critical, critical_cpu, anatomy = [], [], []
    steps = result["steps"]
    for i, s in enumerate(steps[:-1]):
        if not s["measured"]:
            continue
        nxt = steps[i + 1]
        critical.append(s["log_s"] + nxt["enter_s"])
        critical_cpu.append(s["log_cpu_s"] + nxt["enter_cpu_s"])
        if s["step"] in by_step:
            anatomy.append(by_step[s["step"]]["anatomy_s"])
    hosts = result["host_stats"].values()
    rank_steps = sum(h["calls_measured"] for h in hosts) / 4
    call_cpu = sum(h["call_cpu_s"] for h in hosts)
    otel_cpu = sum(h["window"].get("otel_cpu_s", 0.0) for h in hosts)
    proc_cpu = sum(h["window"].get("process_cpu_s", 0.0) for h in hosts)
    world = result["world"]
    gw, ag, down = (result["collectors"][k] for k in ("gateway", "agent", "downstream"))
    sinks: dict[str, dict[str, int]] = {}
    for h in hosts:
        for name, counts in h["sinks"].items():
            into = sinks.setdefault(name, {})
            for key, value in counts.items():
                into[key] = into.get(key, 0) + value
    stall_emitted = result["driver_stall_records"] + sum(h["stall_records"] for h in hosts)
    stall_arrived = len(result["receiver"]["stalls"])
    stuck = result["stuck"]
    named = [
        r
        for r in result["receiver"]["stalls"]
        if r["phase"] == "update_actor" and r["role"] == "driver" and r["waiting"] == [result["stuck_rank"]]
    ]
    first_named = min(named, key=lambda r: r["time_ns"]) if named else None
    whole = [w for w in result["whole_trace_s"][1:] if w is not None]
    lags = [lag / 1e6 for step in result["stamp_lags_ns"][1:-1] for lag in step]  # the measured steps' calls
    per_rank_s = (call_cpu + otel_cpu) / rank_steps if rank_steps else float("nan")
    return {
        "world": world,
        "hosts": result["hosts"],
        "measured_steps": len(measured),
        "end_of_step_p50_ms": percentile(critical, 50) * 1e3,
        "end_of_step_p99_ms": percentile(critical, 99) * 1e3,
        "end_of_step_max_ms": max(critical, default=float("nan")) * 1e3,
        "end_of_step_cpu_ms": statistics.mean(critical_cpu) * 1e3 if critical_cpu else float("nan"),
        "log_p50_ms": percentile([s["log_s"] for s in measured], 50) * 1e3,
        "log_max_ms": max(s["log_s"] for s in measured) * 1e3,
        "steps_late": sum(1 for s in measured if s["late_s"] > 0),
        "anatomy_p50_ms": percentile(anatomy, 50) * 1e3,
        "anatomy_max_ms": max(anatomy, default=float("nan")) * 1e3,
        "dispatch_ms_per_step": statistics.mean(s["dispatch_s"] for s in measured) * 1e3,
        "dispatch_cpu_ms_per_step": statistics.mean(s["dispatch_cpu_s"] for s in measured) * 1e3,
        "driver_cpu_ms_per_step": statistics.mean(s["process_cpu_s"] for s in measured) * 1e3,
        "returns_thread_cpu_ms_per_step": statistics.mean(
            s["otel_threads_cpu_s"].get("otel-tracking-returns", 0.0) for s in measured
        )
        * 1e3,
        "ray_wait_calls_per_step": statistics.mean(s["ray_wait"]["wait_calls"] for s in measured),
        "ray_wait_refs_per_step": statistics.mean(s["ray_wait"]["wait_refs"] for s in measured),
        "driver_rss_mb": result["driver_memory_kb"].get("VmHWM", 0) / 1024,
        # per worker-group call (4 N a step): a cost that grows here grows faster than N
        "per_call_us": {
            "anatomy": percentile(anatomy, 50) / (4 * world) * 1e6,
            "dispatch_cpu": statistics.mean(s["dispatch_cpu_s"] for s in measured) / (4 * world) * 1e6,
            "returns_thread_cpu": statistics.mean(
                s["otel_threads_cpu_s"].get("otel-tracking-returns", 0.0) for s in measured
            )
            / (4 * world)
            * 1e6,
            "ray_wait_refs": statistics.mean(s["ray_wait"]["wait_refs"] for s in measured) / (4 * world),
        },
        "rank_cpu_ms_per_step": per_rank_s * 1e3,
        "rank_core_share_at_10s_pct": per_rank_s / 10.0 * 100,
        "rank_calls_cpu_ms_per_step": call_cpu / rank_steps * 1e3 if rank_steps else float("nan"),
        "rank_export_cpu_ms_per_step": otel_cpu / rank_steps * 1e3 if rank_steps else float("nan"),
        "host_process_cpu_ms_per_rank_step": proc_cpu / rank_steps * 1e3 if rank_steps else float("nan"),
        "host_rss_mb_per_rank": sum(h["memory_kb"].get("VmHWM", 0) for h in hosts) / 1024 / world,
        "build_s_per_host": max(result["build_s"]),
        "spans_emitted": result["emitted_spans"],
        "spans_rank_sinks": sinks.get("otlp-traces", {}),
        "spans_driver_sinks": result["driver_sinks"].get("otlp-traces", {}),
        "agent_accepted": ag.get("otelcol_receiver_accepted_spans", 0),
        "agent_refused": ag.get("otelcol_receiver_refused_spans", 0) + ag.get("otelcol_receiver_failed_spans", 0),
        "agent_sent": ag.get("otelcol_exporter_sent_spans", 0),
        "agent_failed": ag.get("otelcol_exporter_send_failed_spans", 0)
        + ag.get("otelcol_exporter_enqueue_failed_spans", 0),
        "gateway_accepted": gw.get("otelcol_receiver_accepted_spans", 0),
        "gateway_refused": gw.get("otelcol_receiver_refused_spans", 0) + gw.get("otelcol_receiver_failed_spans", 0),
        "gateway_sent": gw.get("otelcol_exporter_sent_spans", 0),
        "gateway_failed": gw.get("otelcol_exporter_send_failed_spans", 0)
        + gw.get("otelcol_exporter_enqueue_failed_spans", 0),
        "downstream_accepted": down.get("otelcol_receiver_accepted_spans", 0),
        "receiver_spans": result["receiver"]["spans"],
        "agent_log_records": [
            ag.get("otelcol_receiver_accepted_log_records", 0),
            ag.get("otelcol_exporter_sent_log_records", 0),
        ],
        "gateway_log_records": [
            gw.get("otelcol_receiver_accepted_log_records", 0),
            gw.get("otelcol_exporter_sent_log_records", 0),
        ],
        "stall_records_emitted": stall_emitted,
        "stall_records_arrived": stall_arrived,
        "whole_trace_p50_s": percentile(whole, 50),
        "whole_trace_max_s": max(whole, default=float("nan")),
        "traces_whole": f"{len(whole)}/{len(result['whole_trace_s']) - 1}",
        "rank_end_stamp_lag_p50_ms": percentile(lags, 50),
        "rank_end_stamp_lag_p99_ms": percentile(lags, 99),
        "rank_end_stamp_lag_max_ms": max(lags, default=float("nan")),
        "span_end_to_receiver_p50_s": result["receiver"]["lag_p50_s"],
        "span_end_to_receiver_min_s": result["receiver"]["lag_min_s"],
        "stuck_named_s": (first_named["time_ns"] - stuck["phase_start_ns"]) / 1e9 if first_named else None,
        "stuck_named_arrived_s": (first_named["arrived_ns"] - stuck["phase_start_ns"]) / 1e9 if first_named else None,
        "stuck_record_bytes": first_named["bytes"] if first_named else None,
        "stuck_rank_own_records": sum(
            1 for r in result["receiver"]["stalls"] if r["rank"] == result["stuck_rank"] and r["role"] == "actor"
        ),
        "agent_peak_rss_mb": ag["peak_rss_kb"] / 1024,
        "gateway_peak_rss_mb": gw["peak_rss_kb"] / 1024,
        "agent_cpu_per_step_s": ag["cpu_s"] / len(result["steps"]),
        "gateway_cpu_per_step_s": gw["cpu_s"] / len(result["steps"]),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = [r["world"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    ax = axes[0]
    for key, label in (
        ("end_of_step_p99_ms", "end of step p99 (log + root end + anatomy)"),
        ("anatomy_max_ms", "anatomy, slowest step"),
        ("dispatch_cpu_ms_per_step", "dispatch CPU per step (N calls x 4)"),
        ("returns_thread_cpu_ms_per_step", "returns thread CPU per step"),
    ):
        ax.plot(worlds, [r[key] for r in rows], marker="o", label=label)
    ax.axhline(10, color="grey", linestyle="--", linewidth=0.8, label="goal: end of step 10 ms")
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms", title="driver, per step")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(
        worlds,
        [r["rank_core_share_at_10s_pct"] for r in rows],
        marker="o",
        label="per rank, % of a core at a 10 s step",
    )
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=0.8, label="goal 0.5%")
    ax.set(xscale="log", xlabel="ranks", ylabel="% of a core", title="each rank")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax = axes[2]
    for key, label in (
        ("driver_rss_mb", "driver RSS"),
        ("agent_peak_rss_mb", "agent peak RSS"),
        ("gateway_peak_rss_mb", "gateway peak RSS"),
    ):
        ax.plot(worlds, [r[key] for r in rows], marker="o", label=label)
    ax.set(xscale="log", xlabel="ranks", ylabel="MB", title="memory")
    ax.legend(fontsize=7)
    ax = axes[3]
    ax.plot(
        worlds,
        [(r["stuck_record_bytes"] or 0) / 1024 for r in rows],
        marker="o",
        label="stall record naming the rank, KB",
    )
    ax.axhline(32, color="grey", linestyle="--", linewidth=0.8, label="goal 32 KB")
    ax.set(xscale="log", xlabel="ranks", ylabel="KB", title="one rank stuck")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(worlds, [str(w) for w in worlds])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(rows: list[dict[str, Any]], top: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    lines = [
        f"# bench_scale ({meta['date']})",
        "",
        f"`{meta['command']}`; load average {meta['load_before']} before, {meta['load_after']} after "
        f"({meta['cpus']} cpus, shared). Step {meta['step_s']} s standing for a 10 s step (export interval scaled), "
        f"{meta['steps']} measured steps per N after one warm-up step, then one step with one rank stuck; "
        f"stall bound {meta['bound_s']} s; {meta['ranks_per_host']} ranks per host process at most.",
        "",
    ]
    cols = [
        ("ranks", "world", "{}"),  # the header row
        ("end of step p50 / p99 ms", ("end_of_step_p50_ms", "end_of_step_p99_ms"), "{:.2f} / {:.2f}"),
        ("its CPU ms", "end_of_step_cpu_ms", "{:.2f}"),
        ("log() p50 / max ms", ("log_p50_ms", "log_max_ms"), "{:.2f} / {:.2f}"),
        ("anatomy p50 / max ms", ("anatomy_p50_ms", "anatomy_max_ms"), "{:.2f} / {:.2f}"),
        ("dispatch wall / CPU ms per step", ("dispatch_ms_per_step", "dispatch_cpu_ms_per_step"), "{:.1f} / {:.1f}"),
        ("returns thread CPU ms per step", "returns_thread_cpu_ms_per_step", "{:.1f}"),
        (
            "ray.wait calls / refs handed in, per step",
            ("ray_wait_calls_per_step", "ray_wait_refs_per_step"),
            "{:.0f} / {:.0f}",
        ),
        ("driver CPU ms per step", "driver_cpu_ms_per_step", "{:.0f}"),
        (
            "per call, µs: anatomy / dispatch CPU / returns thread CPU; refs handed to ray.wait",
            ("per_call_us",),
            "{}",
        ),
        ("measured steps that overran the step", "steps_late", "{}"),
        ("driver RSS MB", "driver_rss_mb", "{:.0f}"),
        (
            "rank CPU ms per step (calls + export)",
            ("rank_cpu_ms_per_step", "rank_calls_cpu_ms_per_step", "rank_export_cpu_ms_per_step"),
            "{:.2f} ({:.2f} + {:.2f})",
        ),
        ("rank, % of a core at 10 s", "rank_core_share_at_10s_pct", "{:.3f}%"),
        ("spans emitted / at receiver", ("spans_emitted", "receiver_spans"), "{} / {}"),
        (
            "agent accepted / sent / refused+failed",
            ("agent_accepted", "agent_sent", "agent_refused", "agent_failed"),
            "{:.0f} / {:.0f} / {:.0f}+{:.0f}",
        ),
        (
            "gateway accepted / sent / refused+failed",
            ("gateway_accepted", "gateway_sent", "gateway_refused", "gateway_failed"),
            "{:.0f} / {:.0f} / {:.0f}+{:.0f}",
        ),
        ("stall records emitted / arrived", ("stall_records_emitted", "stall_records_arrived"), "{} / {}"),
        ("step end to whole trace p50 / max s", ("whole_trace_p50_s", "whole_trace_max_s"), "{:.1f} / {:.1f}"),
        (
            "a rank's call end as the driver stamped it, later by p50 / p99 / max ms",
            ("rank_end_stamp_lag_p50_ms", "rank_end_stamp_lag_p99_ms", "rank_end_stamp_lag_max_ms"),
            "{:.1f} / {:.1f} / {:.1f}",
        ),
        (
            "span end to the receiver p50 / min s",
            ("span_end_to_receiver_p50_s", "span_end_to_receiver_min_s"),
            "{:.2f} / {:.2f}",
        ),
        ("stuck rank named after s (record / arrived)", ("stuck_named_s", "stuck_named_arrived_s"), "{} / {}"),
        ("its record, bytes", "stuck_record_bytes", "{}"),
        ("agent / gateway peak RSS MB", ("agent_peak_rss_mb", "gateway_peak_rss_mb"), "{:.0f} / {:.0f}"),
        ("agent / gateway CPU s per step", ("agent_cpu_per_step_s", "gateway_cpu_per_step_s"), "{:.2f} / {:.2f}"),
    ]
    if rows:
        lines.append("| ranks | " + " | ".join(str(r["world"]) for r in rows) + " |")
        lines.append("|---|" + "---|" * len(rows))
    for title, keys, fmt in cols[1:] if rows else []:
        keys = keys if isinstance(keys, tuple) else (keys,)
        cells = []
        for r in rows:
            values = [r.get(k) for k in keys]
            if keys == ("per_call_us",):
                per = r["per_call_us"]
                values = [
                    f"{per['anatomy']:.2f} / {per['dispatch_cpu']:.1f} / {per['returns_thread_cpu']:.1f}; "
                    f"{per['ray_wait_refs']:.1f}"
                ]
            values = [f"{v:.2f}" if isinstance(v, float) and "{}" in fmt else v for v in values]
            try:
                cells.append(fmt.format(*values))
            except (TypeError, ValueError):
                cells.append(" / ".join(str(v) for v in values))
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    if top is not None:
        lines += [
            "",
            "Gateway alone, OTLP/HTTP requests of 512 spans: top clean rate "
            f"**{top['top_clean_spans_per_s']:.0f} spans/s**.",
            "",
        ]
        lines.append(
            "| offered spans/s | achieved | accepted | refused | exporter failed / enqueue failed "
            "| gateway CPU (cores) | RSS MB |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        for lv in top["levels"]:
            lines.append(
                f"| {lv['offered_spans_per_s']} | {lv['achieved_spans_per_s']:.0f} | {lv['accepted']:.0f} "
                f"| {lv['refused']:.0f} | {lv['exporter_send_failed']:.0f} / {lv['exporter_enqueue_failed']:.0f} "
                f"| {lv['gateway_cpu_per_s']:.2f} "
                f"| {lv['gateway_rss_kb'] / 1024:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,64", help="comma-separated rank counts (0: none)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=10.0)
    parser.add_argument("--bound-s", type=float, default=None, help="stall bound (default 1.5 x --step-s)")
    parser.add_argument("--ranks-per-host", type=int, default=256)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--max-rate", action="store_true")
    parser.add_argument("--rates", default="10000,20000,40000,80000,160000,320000")
    parser.add_argument("--rate-seconds", type=float, default=5.0)
    parser.add_argument("--label", default="scale")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    args.bound_s = args.bound_s or 1.5 * args.step_s
    args.rates = [int(r) for r in args.rates.split(",")]
    sizes = [int(s) for s in args.sizes.split(",") if int(s) > 0]
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    raw: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    try:
        for world in sizes:
            print(f"--- {world} ranks", flush=True)
            result = one_size(args, world, workdir / str(world))
            raw.append(result)
            rows.append(summarize(result, args.step_s))
            print(json.dumps(rows[-1]), flush=True)
        top = max_rate(args, workdir / "max-rate") if args.max_rate else None
        watcher = returns_watcher(sizes) if sizes else []
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir}")
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/bench_scale.py " + " ".join(sys.argv[1:]),
        "load_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "cpus": os.cpu_count(),
        "step_s": args.step_s,
        "steps": args.steps,
        "bound_s": args.bound_s,
        "ranks_per_host": args.ranks_per_host,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{time.strftime('%Y-%m-%d', time.gmtime())}-{args.label}"
    stem.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": rows, "max_rate": top, "returns_watcher": watcher, "raw": raw}, indent=1)
    )
    text = markdown(rows, top, meta)
    if watcher:
        text += (
            "\nThe returns watcher alone (`verl/returns.py`), N results ready one at a time over 0.4 s "
            "(stand-in refs, no transport):\n\n| ranks | ray.wait calls | refs handed in | per call "
            "| watcher CPU ms | stamped later than ready, p50 / p99 / max ms |\n|---|---|---|---|---|---|\n"
        )
        for w in watcher:
            late = " / ".join(f"{w[k]:.1f}" for k in ("late_p50_ms", "late_p99_ms", "late_max_ms") if k in w)
            text += (
                f"| {w['world']} | {w['wait_calls']} | {w['wait_refs']} | {w['refs_per_call']:.0f} "
                f"| {w['cpu_ms']:.1f} | {late or '-'} |\n"
            )
    if rows:
        plot(rows, stem.with_suffix(".png"))
        text += f"\nPlot: `{stem.with_suffix('.png').name}` beside this report.\n"
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
