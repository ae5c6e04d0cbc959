"""The trace UI's relay bounds what it inflates: a gzip bomb is refused with 413 before it is
inflated past the relay's cap, and a gzip body under the cap still goes through to Zipkin (a real
HTTP server standing in for Zipkin's intake, on a real socket)."""

from __future__ import annotations

import gzip
import http.client
import json
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from otel_tracking_stack import zipkin_relay


class _Zipkin(BaseHTTPRequestHandler):
    received: list[Any] = []

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        _Zipkin.received.append(json.loads(body))
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def relay() -> Iterator[tuple[str, int]]:
    zipkin = ThreadingHTTPServer(("127.0.0.1", 0), _Zipkin)
    relay = zipkin_relay.Relay(("127.0.0.1", 0), f"http://127.0.0.1:{zipkin.server_address[1]}")
    for server in (zipkin, relay):
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield "127.0.0.1", relay.server_address[1]
    finally:
        for server in (relay, zipkin):
            server.shutdown()
            server.server_close()


def _post(address: tuple[str, int], body: bytes, gzipped: bool) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection(*address, timeout=60)
    headers = {"Content-Type": "application/json"}
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    try:
        connection.request("POST", "/v1/traces", body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def _gzip_bomb(inflated_bytes: int) -> bytes:
    """A gzip stream of ``inflated_bytes`` zero bytes, made a MiB at a time (never held inflated)."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(1 << 20)
    parts = [deflater.compress(chunk) for _ in range(inflated_bytes >> 20)]
    return b"".join([*parts, deflater.flush()])


OTLP = {
    "resourceSpans": [
        {
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "svc"}}]},
            "scopeSpans": [
                {
                    "spans": [
                        {
                            "traceId": "0af7651916cd43dd8448eb211c80319c",
                            "spanId": "b7ad6b7169203331",
                            "name": "rollout",
                            "startTimeUnixNano": "1000000000",
                            "endTimeUnixNano": "2000000000",
                        }
                    ]
                }
            ],
        }
    ]
}


def test_a_gzip_bomb_is_refused_without_being_inflated_past_the_cap(
    relay: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zipkin_relay, "MAX_BODY", 4 << 20)  # the cap, made small for the test: 4 MiB
    bomb = _gzip_bomb(64 << 20)  # inflates to 64 MiB, 16 times the cap
    assert len(bomb) < zipkin_relay.MAX_BODY  # it passes the Content-Length check: only inflating finds it
    status, answer = _post(relay, bomb, gzipped=True)
    assert status == 413, answer
    assert "inflates to more than" in answer["error"]

    # a body under the cap, gzipped, still reaches Zipkin
    _Zipkin.received.clear()
    status, answer = _post(relay, gzip.compress(json.dumps(OTLP).encode()), gzipped=True)
    assert status == 200, answer
    ((span,),) = _Zipkin.received
    assert span["name"] == "rollout" and span["id"] == "b7ad6b7169203331"

    # and a body that says gzip but is not: a clear 400
    status, answer = _post(relay, b"not gzip at all", gzipped=True)
    assert status == 400 and "not gzip" in answer["error"], answer
