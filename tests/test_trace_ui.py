"""The stack's trace UI feed: the relay (OTLP/JSON in) in front of a real Zipkin, read back through
Zipkin's own API; and what the relay answers when Zipkin cannot take the spans, so that the
collector's queue and retry keep them.  And the light path a user starts with: ``otel-tracking
stack up --light`` (Zipkin and the relay alone, the relay taking the library's OTLP/protobuf), a
run's spans sent to it, and the run's link opened in headless chromium."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_tracking_stack import zipkin_relay
from otel_tracking_stack.stack import HOST, fetch_zipkin, find_java
from tests import viewers
from tests.viewers import free_port, http_json, stop_group, wait_for

pytestmark = pytest.mark.stack

TRACE = "5b8efff798038103d269b633813fc60c"
ROOT, CHILD, GRANDCHILD = "eee19b7ec3c1b174", "eee19b7ec3c1b175", "eee19b7ec3c1b176"
RUN_ID = "0123456789abcdef0123456789abcdef"


def _attribute(key: str, value: Any) -> dict[str, Any]:
    kind = {str: "stringValue", bool: "boolValue", int: "intValue", float: "doubleValue"}[type(value)]
    return {"key": key, "value": {kind: str(value) if kind == "intValue" else value}}


def _span(span_id: str, parent: str, name: str, start_ns: int, end_ns: int, **attrs: Any) -> dict[str, Any]:
    span = {
        "traceId": TRACE,
        "spanId": span_id,
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(start_ns),
        "endTimeUnixNano": str(end_ns),
        "attributes": [_attribute(k.replace("_", "."), v) for k, v in attrs.items()],
        "status": {},
    }
    if parent:
        span["parentSpanId"] = parent
    return span


def _request() -> dict[str, Any]:
    """A step's trace as the collector's ``encoding: json`` sends it."""
    t0 = (time.time_ns() - 60 * 10**9) // 1000 * 1000  # a minute ago: inside Zipkin's search window
    update = _span(CHILD, ROOT, "update", t0 + 3_000_000, t0 + 9_500_000, ml_step=7, ml_phase="update")
    update["events"] = [{"timeUnixNano": str(t0 + 4_000_000), "name": "weights synced", "attributes": []}]
    failed = _span(GRANDCHILD, CHILD, "allreduce", t0 + 4_000_000, t0 + 5_000_001, ml_rank=3)
    failed["status"] = {"code": 2, "message": "NCCL timeout"}
    root = _span(ROOT, "", "step", t0, t0 + 10_000_000, ml_step=7, ml_loss=0.25)
    return {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        _attribute("service.name", "GRPO-Demo"),
                        _attribute("ml.run.id", RUN_ID),
                        _attribute("ml.experiment", "exp"),
                    ]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "otel_tracking", "version": "1"},
                        "spans": [root, update, failed],
                    }
                ],
            }
        ]
    }


def _post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict[str, Any], Any]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"{}")


@pytest.fixture(scope="module")
def zipkin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Zipkin (the stack's jar and JVM flags' essentials) on a free loopback port."""
    port = free_port()
    log = tmp_path_factory.mktemp("zipkin") / "zipkin.log"
    command = [str(find_java()), "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-jar"]
    command += [str(fetch_zipkin()), f"--armeria.ports[0].port={port}", f"--armeria.ports[0].ip={HOST}"]
    command += ["--armeria.ports[0].protocols=http"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={"STORAGE_TYPE": "mem"}
        )
    url = f"http://{HOST}:{port}"
    try:
        wait_for(lambda: http_json(f"{url}/health", timeout=2)["status"] == "UP" or None, 180, "Zipkin's health")
        yield url
    finally:
        stop_group(process)


@pytest.fixture
def relay(zipkin: str) -> Iterator[zipkin_relay.Relay]:
    server = zipkin_relay.Relay((HOST, 0), zipkin)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _url(relay: zipkin_relay.Relay) -> str:
    return f"http://{HOST}:{relay.server_address[1]}/v1/traces"


def test_a_steps_trace_arrives_in_zipkin_as_a_tree_with_timings_tags_and_annotations(
    relay: zipkin_relay.Relay, zipkin: str
) -> None:
    status, _, _ = _post(_url(relay), json.dumps(_request()).encode())
    assert status == 200
    spans = {s["id"]: s for s in http_json(f"{zipkin}/api/v2/trace/{TRACE}")}
    assert set(spans) == {ROOT, CHILD, GRANDCHILD}
    root, update, allreduce = spans[ROOT], spans[CHILD], spans[GRANDCHILD]
    assert "parentId" not in root and update["parentId"] == ROOT and allreduce["parentId"] == CHILD
    assert (root["name"], update["name"], allreduce["name"]) == ("step", "update", "allreduce")
    assert (root["duration"], update["duration"], allreduce["duration"]) == (10_000, 6_500, 1_000)
    assert update["timestamp"] - root["timestamp"] == 3_000
    assert root["localEndpoint"] == {"serviceName": "grpo-demo"}  # Zipkin lowercases service names
    assert root["tags"]["ml.step"] == "7" and root["tags"]["ml.loss"] == "0.25"
    assert root["tags"]["ml.run.id"] == RUN_ID and root["tags"]["ml.experiment"] == "exp"
    assert root["tags"]["otel.scope.name"] == "otel_tracking"
    assert allreduce["tags"]["error"] == "NCCL timeout" and allreduce["tags"]["otel.status_code"] == "ERROR"
    assert [a["value"] for a in update["annotations"]] == ["weights synced"]
    # what the run's summary links to: its traces, found by the run's id
    found = http_json(f"{zipkin}/api/v2/traces?serviceName=grpo-demo&annotationQuery=ml.run.id%3D{RUN_ID}")
    assert [{s["id"] for s in trace} for trace in found] == [{ROOT, CHILD, GRANDCHILD}]


def test_while_zipkin_cannot_take_spans_the_relay_answers_503_so_the_collector_retries(
    relay: zipkin_relay.Relay, zipkin: str
) -> None:
    relay.zipkin_url = f"http://{HOST}:{free_port()}"  # nobody listens there
    status, headers, body = _post(_url(relay), json.dumps(_request()).encode())
    assert status == 503 and headers["Retry-After"] == "1"
    assert "Zipkin is not reachable" in body["error"]
    relay.zipkin_url = zipkin  # Zipkin back: the collector's retry gets 200
    assert _post(_url(relay), json.dumps(_request()).encode())[0] == 200


def test_the_relay_refuses_what_it_cannot_translate_with_a_clear_error(
    relay: zipkin_relay.Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    status, _, body = _post(_url(relay), b"<spans/>", content_type="application/xml")
    assert status == 415 and "OTLP/JSON or OTLP/protobuf only" in body["error"]
    status, _, body = _post(_url(relay), b"\xff\xff\xff", content_type="application/x-protobuf")
    assert status == 400 and "not an OTLP/protobuf traces request" in body["error"]
    status, _, body = _post(_url(relay), b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x"}]}]}]}')
    assert status == 400 and "not OTLP traces" in body["error"]
    monkeypatch.setattr(zipkin_relay, "MAX_BODY", 1000)
    status, _, body = _post(_url(relay), json.dumps(_request()).encode())
    assert status == 413 and "more than 1000" in body["error"]
    assert http_json(f"http://{HOST}:{relay.server_address[1]}/health")["status"] == "ok"


# --- the light path: one command, a run, its trace in a browser ---------------------------------------

REPO = Path(__file__).resolve().parents[1]
RUN = """
from otel_tracking import Tracking, trace_state

tracking = Tracking(project_name="light-trace-ui", experiment_name="first", default_backend=["console"])
for step in range(1, 3):
    with trace_state("rollout"):
        with trace_state("generate", state_lane_id="worker_0"):
            pass
    with trace_state("update"):
        pass
    tracking.log({"actor/pg_loss": 1.0 / step}, step=step)
tracking.finish()
"""


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "otel_tracking", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_stack_up_light_shows_a_runs_traces_in_the_browser(isolated: Path) -> None:
    """What the README tells a user to do: ``stack up --light``, export what it prints, run, open the
    link the run's summary prints: the run's steps are listed, and a step's waterfall shows its phases.
    No collector, Jaeger or Prometheus runs: the relay takes the library's OTLP/protobuf itself."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    state = ["--state-dir", str(isolated / "stack")]
    up = _cli("stack", "up", "--light", "--free-ports", *state, env=env)
    try:
        assert up.returncode == 0, up.stderr
        exports = dict(re.findall(r"^export (\w+)=(\S+)$", up.stdout, re.M))
        printed = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACKING_TRACES_URL"}
        assert set(exports) == printed
        saved = json.loads((isolated / "stack" / "stack.json").read_text())
        assert saved["light"] is True and set(saved["binaries"]) == {"zipkin", "java"}  # nothing built
        status = _cli("stack", "status", "--json", *state, env=env)
        assert set(json.loads(status.stdout)) == {"zipkin", "trace_ui_relay"} and status.returncode == 0

        script = isolated / "run.py"
        script.write_text(RUN)
        done = subprocess.run(
            [sys.executable, str(script)], env={**env, **exports}, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        # every span reached the relay and none was spooled; metrics and logs were answered and dropped
        assert re.search(r"otlp-traces: \d+ items delivered, 0 spooled, 0 dropped .*; 0 exports failed", done.stderr)
        assert "otel-tracking replay" not in done.stderr
        link = re.search(r"^otel-tracking: the run's traces: (\S+)$", done.stderr, re.M)
        assert link and link.group(1).startswith(exports["OTEL_TRACKING_TRACES_URL"]), done.stderr

        zipkin = exports["OTEL_TRACKING_TRACES_URL"].removesuffix("/zipkin/")
        port = int(zipkin.rsplit(":", 1)[1])
        trace_id = viewers.step_trace_id(port, 2, service="light-trace-ui")
        with viewers.browser() as browser:
            listing = browser.page(link.group(1))
            text = listing.wait_for_text(["Results", "light-trace-ui: ml.step"])
            assert text.count("light-trace-ui: ml.step") == 2  # one trace per step
            page = browser.page(f"{exports['OTEL_TRACKING_TRACES_URL']}traces/{trace_id}")
            text = page.wait_for_text(["Total Spans", "Tags", "ml.step"])
            assert re.search(r"Total Spans\n4\n", text)
            rows = re.findall(r"^light-trace-ui: ([\w.]+)\n([\d.]+(?:μs|ms|s))$", text, re.M)
            assert [name for name, _ in rows] == ["ml.step", "rollout", "generate", "update"], text[:2000]
    finally:
        down = _cli("stack", "down", *state, env=env)
        assert down.returncode == 0, down.stderr
