"""The collectors of the scale bench, and what counts what arrived.

* the **agent**: ``deploy/collector/agent.yaml`` as it ships (``otel_tracking_stack.stack.Agent``),
  one for the whole simulated job (production runs one per node);
* the **gateway**: the stack's ``collector-config.yaml`` with two changes, both said here: its own
  telemetry is on (Prometheus pull on a free port; it ships with ``level: none``), and its logs
  pipeline also exports to the receiver, so that the stall records can be read (it ships with
  ``debug`` only).  Its Jaeger exporter points at the receiver, its trace-UI exporter at the
  downstream collector; span metrics, memory limiter and batching as shipped;
* the **downstream** collector: otelcol with OTLP in and ``debug`` out, standing where the trace
  UI (and, for the gateway's top rate, Jaeger) would be;
* the **receiver**: an OTLP/gRPC server in the bench's own process that notes, per trace, when
  each span arrived, and keeps each stall record (``ml.stall``) with its size.

Each collector's counts come from its own telemetry (accepted, refused, sent, send failed,
enqueue failed), read from its Prometheus endpoint.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def prometheus_counts(port: int) -> dict[str, float]:
    """A collector's own telemetry, each series summed over its labels, ``_total`` dropped."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if match:
            name = match.group(1).removesuffix("_total")
            sums[name] = sums.get(name, 0.0) + float(match.group(3))
    return sums


def memory_kb(pid: int) -> dict[str, int]:
    found = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0])
    except OSError:
        pass
    return found


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return 0.0


class Otelcol:
    """otelcol with a config file written here; stopped by its pid."""

    def __init__(self, workdir: Path, name: str, config: str, env: dict[str, str], metrics_port: int) -> None:
        from otel_tracking_stack.stack import build_collector

        self.binary = build_collector()  # the cached binary
        self.workdir, self.name, self.metrics_port = workdir, name, metrics_port
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(config)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_port: int) -> Otelcol:
        log = (self.workdir / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            [str(self.binary), "--config", str(self.config_path)],
            env={**os.environ, **self.env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_listening(ready_port, self.proc, self.workdir / f"{self.name}.log")
        wait_listening(self.metrics_port, self.proc, self.workdir / f"{self.name}.log")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def counts(self) -> dict[str, float]:
        return prometheus_counts(self.metrics_port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name}: exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{log.name}: port {port} not open after {timeout_s} s") from None
            time.sleep(0.1)


def telemetry(port: int, level: str) -> dict[str, Any]:
    return {
        "logs": {"level": "warn"},
        "metrics": {
            "level": level,
            "readers": [
                {
                    "pull": {
                        "exporter": {
                            "prometheus": {
                                "host": HOST,
                                "port": port,
                                "without_scope_info": True,
                                "without_units": True,
                                "without_type_suffix": True,
                            }
                        }
                    }
                }
            ],
        },
    }


def downstream(workdir: Path) -> tuple[Otelcol, int, int]:
    """(collector, OTLP/gRPC port, OTLP/HTTP port): OTLP in, ``debug`` (basic) out."""
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    config = {
        "receivers": {
            "otlp": {
                "protocols": {"grpc": {"endpoint": f"{HOST}:{grpc_port}"}, "http": {"endpoint": f"{HOST}:{http_port}"}}
            }
        },
        "exporters": {"debug": {"verbosity": "basic"}},
        "service": {
            "telemetry": telemetry(metrics_port, "basic"),
            "pipelines": {s: {"receivers": ["otlp"], "exporters": ["debug"]} for s in ("traces", "logs", "metrics")},
        },
    }
    col = Otelcol(workdir, "downstream", yaml.safe_dump(config), {}, metrics_port)
    return col.start(http_port), grpc_port, http_port


def gateway(workdir: Path, jaeger_grpc: str, trace_ui_http: str, logs_to_jaeger: bool) -> tuple[Otelcol, int, int]:
    """(collector, OTLP/gRPC port, OTLP/HTTP port): the stack's gateway config, its own telemetry on."""
    from otel_tracking_stack.stack import COLLECTOR_CONFIG

    config = yaml.safe_load(COLLECTOR_CONFIG.read_text())
    metrics_port = free_port()
    config["service"]["telemetry"] = telemetry(metrics_port, "normal")
    if logs_to_jaeger:
        config["service"]["pipelines"]["logs"]["exporters"].append("otlp_grpc/jaeger")
    grpc_port, http_port = free_port(), free_port()
    targets = workdir / "scrape-targets"
    targets.mkdir(parents=True, exist_ok=True)
    env = {
        "OTEL_TRACKING_HOST": HOST,
        "OTEL_TRACKING_OTLP_HOST": HOST,
        "OTEL_TRACKING_OTLP_GRPC_PORT": str(grpc_port),
        "OTEL_TRACKING_OTLP_HTTP_PORT": str(http_port),
        "OTEL_TRACKING_HEALTH_PORT": str(free_port()),
        "OTEL_TRACKING_PROM_EXPORTER_PORT": str(free_port()),
        "OTEL_TRACKING_JAEGER_OTLP_ENDPOINT": jaeger_grpc,
        "OTEL_TRACKING_TRACE_UI_ENDPOINT": trace_ui_http,
        "OTEL_TRACKING_SCRAPE_TARGETS_DIR": str(targets),
    }
    col = Otelcol(workdir, "gateway", yaml.safe_dump(config), env, metrics_port)
    return col.start(grpc_port), grpc_port, http_port


def agent(workdir: Path, gateway_grpc_port: int) -> Any:
    from otel_tracking_stack.stack import Agent, AgentPorts

    return Agent(workdir / "agent", f"{HOST}:{gateway_grpc_port}", AgentPorts.free(), node_name="node-all").start()


# --- the receiver --------------------------------------------------------------------------------


class Receiver:
    """OTLP/gRPC traces and logs: per trace, (arrival time, spans) of each request; each stall
    record with its size; each span's lag from its end to its arrival."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrivals: dict[str, list[tuple[int, int]]] = {}  # trace id -> [(arrival ns, spans)]
        self.spans = 0
        self.rank_spans = 0
        self.lags_ns: list[int] = []  # a sample: span end -> arrival here
        self.stalls: list[dict[str, Any]] = []
        self.log_records = 0
        self.port = free_port()
        self._server: Any = None

    def start(self) -> Receiver:
        import grpc
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                receiver.took_spans(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                receiver.took_logs(request)
                return logs_service_pb2.ExportLogsServiceResponse()

        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), self._server)
        self._server.add_insecure_port(f"{HOST}:{self.port}")
        self._server.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    def took_spans(self, request: Any) -> None:
        now = time.time_ns()
        per_trace: dict[str, int] = {}
        spans = ranked = 0
        lags = []
        for rs in request.resource_spans:
            is_rank = any(kv.key == "ml.role" and kv.value.string_value == "actor" for kv in rs.resource.attributes)
            for ss in rs.scope_spans:
                for span in ss.spans:
                    key = span.trace_id.hex()
                    per_trace[key] = per_trace.get(key, 0) + 1
                    spans += 1
                    ranked += is_rank
                    if spans % 16 == 0:
                        lags.append(now - span.end_time_unix_nano)
        with self.lock:
            for key, n in per_trace.items():
                self.arrivals.setdefault(key, []).append((now, n))
            self.spans += spans
            self.rank_spans += ranked
            self.lags_ns.extend(lags)

    def took_logs(self, request: Any) -> None:
        now = time.time_ns()
        for rl in request.resource_logs:
            resource = {kv.key: _value(kv.value) for kv in rl.resource.attributes}
            for sl in rl.scope_logs:
                for record in sl.log_records:
                    with self.lock:
                        self.log_records += 1
                    if record.event_name != "ml.stall":
                        continue
                    attributes = {kv.key: _value(kv.value) for kv in record.attributes}
                    with self.lock:
                        self.stalls.append(
                            {
                                "arrived_ns": now,
                                "time_ns": record.time_unix_nano,
                                "bytes": record.ByteSize(),
                                "phase": attributes.get("ml.phase"),
                                "waiting": attributes.get("ml.stall.waiting_ranks"),
                                "rank": resource.get("ml.rank"),
                                "role": resource.get("ml.role"),
                            }
                        )

    def whole_trace_ns(self, trace_id: str, expected: int) -> int | None:
        """When the ``expected``-th span of the trace arrived."""
        with self.lock:
            seen = 0
            for at, n in self.arrivals.get(trace_id, []):
                seen += n
                if seen >= expected:
                    return at
        return None

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
