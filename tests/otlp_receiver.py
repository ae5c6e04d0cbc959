"""A real OTLP endpoint for tests: decodes the protobufs that arrive over HTTP or gRPC.

It is a tiny collector (the real Collector runs in the stack tests): it answers like one, keeps
every decoded request, and offers the views tests assert on: gauge points by name, spans with
their parent links, resources, log records, and the request headers.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.conftest import free_port


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def attributes(items: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in items}


@dataclass
class Received:
    metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = field(default_factory=list)
    traces: list[trace_service_pb2.ExportTraceServiceRequest] = field(default_factory=list)
    logs: list[logs_service_pb2.ExportLogsServiceRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set `unavailable` to answer every request with a retryable failure (HTTP 503 / gRPC
    # UNAVAILABLE); `refused` counts those requests per signal.
    unavailable: bool = False
    refused: dict[str, int] = field(default_factory=dict)
    # Set `answer_after_s` to hold each answer that long after the request was taken (a slow
    # collector: what a sender killed meanwhile sent has arrived, and the sender never knew).
    answer_after_s: float = 0.0

    def refuse(self, kind: str) -> bool:
        with self.lock:
            if self.unavailable:
                self.refused[kind] = self.refused.get(kind, 0) + 1
            return self.unavailable

    def add(self, kind: str, message: Any, headers: dict[str, str]) -> None:
        with self.lock:
            getattr(self, kind).append(message)
            self.headers.append(headers)

    # --- views -----------------------------------------------------------------------------------

    def gauge_points(self) -> Iterator[tuple[dict[str, Any], str, str, Any, dict[str, Any]]]:
        """(resource attributes, metric name, description, value, point attributes)."""
        with self.lock:
            requests = list(self.metrics)
        for request in requests:
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        for point in metric.gauge.data_points:
                            value = point.as_double if point.HasField("as_double") else point.as_int
                            yield resource, metric.name, metric.description, value, attributes(point.attributes)

    def last_gauges(self) -> dict[str, Any]:
        return {name: value for _, name, _, value, _ in self.gauge_points()}

    def spans(self) -> list[dict[str, Any]]:
        with self.lock:
            requests = list(self.traces)
        result = []
        for request in requests:
            for rs in request.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        result.append(
                            {
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex() or None,
                                "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                                "attributes": attributes(span.attributes),
                                "resource": resource,
                            }
                        )
        return result

    def write_traces_as_otlp_json(self, path: Path) -> None:
        """What arrived, one OTLP/JSON request per line, as a collector's ``file`` exporter writes
        it (ids in hex, as the OTLP/JSON encoding has them, not protobuf JSON's base64)."""
        from google.protobuf.json_format import MessageToDict

        with self.lock:
            requests = list(self.traces)
        with open(path, "w") as out:
            for request in requests:
                encoded = MessageToDict(request)
                for rs in encoded.get("resourceSpans", []):
                    for ss in rs.get("scopeSpans", []):
                        for span in ss.get("spans", []):
                            for key in ("traceId", "spanId", "parentSpanId"):
                                if key in span:
                                    span[key] = base64.b64decode(span[key]).hex()
                out.write(json.dumps(encoded) + "\n")

    def log_records(self) -> list[dict[str, Any]]:
        with self.lock:
            requests = list(self.logs)
        result = []
        for request in requests:
            for rl in request.resource_logs:
                for sl in rl.scope_logs:
                    for record in sl.log_records:
                        result.append(
                            {
                                "event_name": record.event_name,
                                "body": any_value(record.body),
                                "attributes": attributes(record.attributes),
                                "resource": attributes(rl.resource.attributes),
                            }
                        )
        return result


def wait_for(predicate: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


_HTTP_PATHS = {
    "/v1/metrics": (
        "metrics",
        metrics_service_pb2.ExportMetricsServiceRequest,
        metrics_service_pb2.ExportMetricsServiceResponse,
    ),
    "/v1/traces": ("traces", trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse),
    "/v1/logs": ("logs", logs_service_pb2.ExportLogsServiceRequest, logs_service_pb2.ExportLogsServiceResponse),
}


class HttpReceiver:
    """OTLP/HTTP (protobuf) on 127.0.0.1; over TLS when given a (certificate, key) pair."""

    def __init__(self, port: int | None = None, tls: tuple[Path, Path] | None = None) -> None:
        self.received = Received()
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                route = _HTTP_PATHS.get(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if route is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                kind, request_type, response_type = route
                if received.refuse(kind):
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    import gzip

                    body = gzip.decompress(body)
                message = request_type()
                message.ParseFromString(body)
                received.add(kind, message, {k.lower(): v for k, v in self.headers.items()})
                if received.answer_after_s:
                    time.sleep(received.answer_after_s)
                payload = response_type().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                return None

        self.port = port or free_port()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.scheme = "http"
        if tls is not None:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def __enter__(self) -> HttpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcReceiver:
    """OTLP/gRPC on 127.0.0.1."""

    def __init__(self) -> None:
        import grpc

        self.received = Received()
        received = self.received

        def meta(context: Any) -> dict[str, str]:
            return {k.lower(): v for k, v in context.invocation_metadata()}

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                if received.refuse("metrics"):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "refused by the test")
                received.add("metrics", request, meta(context))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                if received.refuse("traces"):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "refused by the test")
                received.add("traces", request, meta(context))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                if received.refuse("logs"):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "refused by the test")
                received.add("logs", request, meta(context))
                return logs_service_pb2.ExportLogsServiceResponse()

        self.port = free_port()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._server)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> GrpcReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.stop(grace=None)
