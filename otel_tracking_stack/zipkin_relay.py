"""A small HTTP relay in front of Zipkin: OTLP/HTTP traces in, Zipkin v2 JSON out.

The collector's ``otlp_http/trace_ui`` exporter posts OTLP/JSON to ``/v1/traces`` here.  In a light
stack (``otel-tracking stack up --light``) the library posts to the relay directly, OTLP/protobuf on
the OTLP/HTTP port: the relay decodes it with ``opentelemetry-proto`` (installed with otel-tracking),
and answers ``/v1/metrics`` and ``/v1/logs`` with 200 and drops them (Zipkin shows traces only; the
full stack keeps them).  Each traces request is
translated (``zipkin_spans.py``) and posted to Zipkin's ``/api/v2/spans`` before it is answered,
so the relay holds no queue of its own and its memory is bounded by ``MAX_CONCURRENT`` requests
of at most ``MAX_BODY`` bytes.  Whatever goes wrong on Zipkin's side is answered 503: the
collector's own sending queue and retry keep the spans (and never block its other exporters,
Jaeger among them) until Zipkin answers again; the library's sinks retry and spool the same way.
Standard library only, but for the protobuf decoding.

Run by ``otel-tracking stack up``; by hand::

    python -m otel_tracking_stack.zipkin_relay --port 9412 --zipkin http://127.0.0.1:9411
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import signal
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from otel_tracking_stack.zipkin_spans import spans_from_otlp

MAX_BODY = 64 * 1024 * 1024  # a collector batch is far smaller; larger is refused (413)
MAX_CONCURRENT = 4  # more requests at once are answered 503, and the collector retries them
ZIPKIN_TIMEOUT_S = 10.0
PROTOBUF = "application/x-protobuf"


def otlp_json_from_protobuf(body: bytes) -> dict[str, Any]:
    """An OTLP/protobuf ``ExportTraceServiceRequest`` as OTLP/JSON (ids in hex, as OTLP/JSON has them;
    protobuf's JSON mapping gives them in base64)."""
    from google.protobuf.json_format import MessageToDict
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    try:
        data: dict[str, Any] = MessageToDict(ExportTraceServiceRequest.FromString(body))
    except DecodeError as err:
        raise ValueError(f"not an OTLP/protobuf traces request ({err})") from err

    def hex_ids(item: dict[str, Any]) -> None:
        for key in ("traceId", "spanId", "parentSpanId"):
            if item.get(key):
                item[key] = base64.b64decode(item[key]).hex()

    for resource_spans in data.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                hex_ids(span)
                for link in span.get("links", []):
                    hex_ids(link)
    return data


class Relay(ThreadingHTTPServer):
    """The relay's server: ``zipkin_url`` is Zipkin's base URL (``http://127.0.0.1:9411``)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], zipkin_url: str) -> None:
        super().__init__(address, _Handler)
        self.zipkin_url = zipkin_url.rstrip("/")
        self.slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self.forwarded = 0  # spans Zipkin accepted, for /health
        self.dropped_requests = 0  # metrics and logs requests answered and dropped, for /health


class _Handler(BaseHTTPRequestHandler):
    server: Relay
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return  # one line per request would fill the stack's log

    def _answer_ok(self, protobuf: bool = False) -> None:
        """200 with an empty export response: ``{}``, or the empty protobuf message."""
        if not protobuf:
            self._answer(200, {})
            return
        self.send_response(200)
        self.send_header("Content-Type", PROTOBUF)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if code == 503:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("", "/health"):
            self._answer(
                200,
                {
                    "status": "ok",
                    "zipkin": self.server.zipkin_url,
                    "forwarded": self.server.forwarded,
                    "dropped_requests": self.server.dropped_requests,
                },
            )
        else:
            self._answer(404, {"error": f"no {self.path}"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if self.path in ("/v1/metrics", "/v1/logs"):
            self.rfile.read(length)
            self.server.dropped_requests += 1
            self._answer_ok()
            return
        if self.path != "/v1/traces":
            self._answer(404, {"error": f"only /v1/traces, not {self.path}"})
            return
        if length > MAX_BODY:
            self.close_connection = True
            self._answer(413, {"error": f"body of {length} bytes, more than {MAX_BODY}"})
            return
        if not self.server.slots.acquire(blocking=False):
            self.rfile.read(length)
            self._answer(503, {"error": "busy"})
            return
        try:
            body = self.rfile.read(length)
            content_type = self.headers.get("Content-Type", "application/json").split(";")[0].strip().lower()
            if content_type not in ("application/json", PROTOBUF):
                self._answer(415, {"error": f"OTLP/JSON or OTLP/protobuf only, not {content_type}"})
                return
            if self.headers.get("Content-Encoding", "").lower() == "gzip":
                body = gzip.decompress(body)
            try:
                request = json.loads(body) if content_type == "application/json" else otlp_json_from_protobuf(body)
                spans = list(spans_from_otlp(request))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                self._answer(400, {"error": f"not OTLP traces: {err}"})
                return
            code, detail = self._forward(spans)
            if code == 200:
                self._answer_ok(protobuf=content_type == PROTOBUF)
            else:
                self._answer(code, {"error": detail})
        finally:
            self.server.slots.release()

    def _forward(self, spans: list[dict[str, Any]]) -> tuple[int, str]:
        if not spans:
            return 200, ""
        request = urllib.request.Request(
            f"{self.server.zipkin_url}/api/v2/spans",
            data=json.dumps(spans, allow_nan=False, default=str).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=ZIPKIN_TIMEOUT_S) as response:
                response.read()
        except urllib.error.HTTPError as err:
            # Zipkin refused the data itself: retrying cannot help; anything else may pass later.
            if 400 <= err.code < 500:
                return 400, f"Zipkin answered {err.code}: {err.read()[:200]!r}"
            return 503, f"Zipkin answered {err.code}"
        except (OSError, ValueError) as err:
            return 503, f"Zipkin is not reachable: {err}"
        self.server.forwarded += len(spans)
        return 200, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m otel_tracking_stack.zipkin_relay", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9412)
    parser.add_argument("--zipkin", default="http://127.0.0.1:9411", help="Zipkin's base URL")
    args = parser.parse_args(argv)
    relay = Relay((args.host, args.port), args.zipkin)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=relay.shutdown, daemon=True).start())
    try:
        relay.serve_forever(poll_interval=0.2)
    finally:
        relay.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
