"""OTLP export from the facade, over HTTP and gRPC, to a local endpoint that decodes the protobufs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_tracking import Tracking, trace_state
from tests.otlp_receiver import GrpcReceiver, HttpReceiver, wait_for

RECEIVERS = {"http/protobuf": HttpReceiver, "grpc": GrpcReceiver}


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_gauges_resource_and_span_tree_arrive(protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with RECEIVERS[protocol]() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "grpo-trainer")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=rl")
        monkeypatch.setenv("RANK", "3")
        tracking = Tracking("proj", "exp-1", default_backend="file")
        with trace_state("step"):
            with trace_state("rollout", state_lane_id=2, model="actor"):
                pass
            with trace_state("update"):
                pass
        tracking.log({"train/loss": 0.5, "val-core/openai/gsm8k/reward/mean@4": 0.75, "loss_nan": float("nan")}, 1)
        tracking.log({"train/loss": 0.25, "count": 7}, 2)
        tracking.finish()

        gauges = wait_for(receiver.received.last_gauges, what="gauges")
        assert gauges["train/loss"] == 0.25
        assert gauges["count"] == 7
        assert gauges["train.step"] == 2
        assert math.isnan(gauges["loss_nan"]), "NaN must reach OTLP (the SDK's own gauge would drop it)"
        # The one naming rule: '@' -> '_at_'; the original key rides along as the description.
        described = {name: description for _, name, description, _, _ in receiver.received.gauge_points()}
        assert described["val-core/openai/gsm8k/reward/mean_at_4"] == "val-core/openai/gsm8k/reward/mean@4"
        # The step is a gauge, never a per-step attribute.
        assert all(not point_attributes for *_, point_attributes in receiver.received.gauge_points())

        resource = next(iter(receiver.received.gauge_points()))[0]
        assert resource["service.name"] == "grpo-trainer"
        assert resource["ml.project"] == "proj"
        assert resource["ml.experiment"] == "exp-1"
        assert resource["ml.run.id"] == tracking.run_id
        assert resource["ml.rank"] == 3
        assert resource["host.name"]
        assert resource["deployment.environment"] == "test"

        spans = wait_for(lambda: len(receiver.received.spans()) >= 4 and receiver.received.spans(), what="spans")
        by_name = {span["name"]: span for span in spans}
        root = by_name["step"]
        # Outside any span, the phase hangs under the step's root span: one trace per step.
        assert root["parent_span_id"] == by_name["ml.step"]["span_id"]
        assert by_name["ml.step"]["parent_span_id"] is None and by_name["ml.step"]["attributes"]["ml.step"] == 1
        for child in ("rollout", "update"):
            assert by_name[child]["parent_span_id"] == root["span_id"]
            assert by_name[child]["trace_id"] == root["trace_id"]
        assert by_name["rollout"]["attributes"]["ml.lane"] == 2
        assert by_name["rollout"]["attributes"]["ml.label.model"] == "actor"
        assert by_name["rollout"]["resource"]["service.name"] == "grpo-trainer"


def test_generations_travel_as_log_records(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_tracking import ValidationGenerationsLogger

    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("proj", "exp", default_backend="console")
        ValidationGenerationsLogger("proj", "exp").log(["wandb"], [("2+2?", "4", 1.0), ("3+3?", "7", 0.0)], step=5)
        tracking.finish()
        records = wait_for(receiver.received.log_records, what="log records")
        (record,) = records
        assert record["event_name"] == "ml.validation.generations"
        assert record["attributes"]["ml.step"] == 5
        assert record["body"] == {"samples": [["2+2?", "4", 1.0], ["3+3?", "7", 0.0]]}


def test_headers_are_sent_but_never_recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    secret = "s3cr3t-token-value"
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{secret}")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"api_key={secret},team=rl")
        tracking = Tracking("proj", "exp", default_backend="file", config={"trainer": {"api_key": secret}})
        with trace_state("rollout", token=secret):
            tracking.log({"x": 1.0}, 1)
        where = tracking.where()
        tracking.finish()
        wait_for(receiver.received.spans, what="spans")
        assert any(h.get("authorization") == f"Bearer {secret}" for h in receiver.received.headers)
        assert secret not in json.dumps(where)
        for span in receiver.received.spans():
            assert secret not in json.dumps(span)
        for resource, *_ in receiver.received.gauge_points():
            assert secret not in json.dumps(resource)
    for path in tmp_path.rglob("*.jsonl"):
        assert secret not in path.read_text()


def test_metrics_exporter_otlp_and_file_through_the_facade(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp,file")
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
        tracking = Tracking("proj", "exp", default_backend="console")
        tracking.log({"loss": 1.5}, 1)
        tracking.log({"loss": 1.25}, 2)
        tracking.finish()
        assert wait_for(receiver.received.last_gauges, what="gauges")["loss"] == 1.25
        assert receiver.received.traces == []
    lines = [json.loads(line) for line in (tmp_path / "proj" / "exp.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "data": {"loss": 1.5}}, {"step": 2, "data": {"loss": 1.25}}]


def test_a_gauge_set_once_is_not_repeated_at_later_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain SDK MeterProvider with our file exporter: synchronous gauges are collected as DELTA
    (the exporter keys its preferred temporality by the SDK's Gauge class, compat/otel_sdk.py's
    sdk_gauge_class), so a key set at one step is not repeated at the steps after it."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    from otel_tracking.exporters.file import FileMetricExporter

    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path))
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "ml.project=plain,ml.experiment=delta")
    reader = PeriodicExportingMetricReader(FileMetricExporter(), export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("app")
    step, loss, rare = (meter.create_gauge(name) for name in ("train.step", "train/loss", "rare"))
    for i in range(3):
        step.set(i)
        loss.set(i / 4)
        if i == 0:
            rare.set(9.0)
        assert provider.force_flush()
    provider.shutdown()
    lines = [json.loads(line) for line in (tmp_path / "plain" / "delta.jsonl").read_text().splitlines()]
    assert [(line["step"], line["data"]) for line in lines] == [
        (0, {"train/loss": 0.0, "rare": 9.0}),
        (1, {"train/loss": 0.25}),
        (2, {"train/loss": 0.5}),
    ]


def test_plain_sdk_autoconfiguration_finds_our_file_exporter(tmp_path: Path) -> None:
    """No facade: the SDK's own auto-configuration loads `file` by entry point beside `otlp`."""
    script = textwrap.dedent(
        """
        from opentelemetry import metrics, trace
        from opentelemetry.sdk._configuration import _OTelSDKConfigurator

        _OTelSDKConfigurator().configure()
        meter = metrics.get_meter("app")
        loss = meter.create_gauge("train/loss")
        step = meter.create_gauge("train.step")
        for i in range(3):
            step.set(i)
            loss.set(1.0 / (i + 1))
            metrics.get_meter_provider().force_flush()
        with trace.get_tracer("app").start_as_current_span("epoch"):
            pass
        metrics.get_meter_provider().shutdown()
        trace.get_tracer_provider().shutdown()
        """
    )
    with HttpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            OTEL_METRICS_EXPORTER="otlp,file",
            OTEL_TRACES_EXPORTER="file",
            OTEL_LOGS_EXPORTER="none",
            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_RESOURCE_ATTRIBUTES="ml.project=plain,ml.experiment=sdk",
            VERL_FILE_LOGGER_ROOT=str(tmp_path),
        )
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60, cwd=tmp_path)
        assert wait_for(receiver.received.last_gauges, what="gauges")["train/loss"] == pytest.approx(1 / 3)
    lines = [json.loads(line) for line in (tmp_path / "plain" / "sdk.jsonl").read_text().splitlines()]
    assert [(line["step"], line["data"]) for line in lines] == [
        (0, {"train/loss": 1.0}),
        (1, {"train/loss": 0.5}),
        (2, {"train/loss": pytest.approx(1 / 3)}),
    ]
    events = [json.loads(line) for line in (tmp_path / "plain" / "sdk.events.jsonl").read_text().splitlines()]
    assert [event["name"] for event in events if event["type"] == "span"] == ["epoch"]


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_otlp_over_tls_with_headers_from_the_standard_variables(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed_certificate(isolated)
    with HttpReceiver(tls=(cert, key)) as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(cert))
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=rl-team,authorization=Bearer%20abc")
        tracking = Tracking("proj", "tls", default_backend="console")
        with trace_state("rollout"):
            tracking.log({"loss": 0.5}, 1)
        stats = tracking.finish()
        assert receiver.endpoint.startswith("https://")
        assert stats["otlp-traces"]["delivered"] == 2 and stats["otlp-metrics"]["failed"] == 0
        # log() inside the phase closes the step; its root ends after the phase, which it encloses
        assert [s["name"] for s in receiver.received.spans()] == ["rollout", "ml.step"]
        assert receiver.received.last_gauges()["loss"] == 0.5
        assert all(h["x-tenant"] == "rl-team" and h["authorization"] == "Bearer abc" for h in receiver.received.headers)


def test_an_unreachable_endpoint_is_one_clear_warning_at_construction(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.conftest import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_TRACKING_FINISH_TIMEOUT", "1")
    tracking = Tracking("proj", "exp", default_backend="console")
    warnings = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    assert warnings == [
        f"otel-tracking: the OTLP endpoint {endpoint} is not reachable now (Connection refused); "
        "telemetry for it is retried and spooled until it is (see `otel-tracking replay`)"
    ]
    tracking.finish()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_one_retry_policy_ours_not_the_sdk_exporters_loop_inside_it(
    protocol: str, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's OTLP exporters retry a 503/UNAVAILABLE up to 6 times with 1, 2, 4 ... s pauses
    inside each export call; wrapped in our attempts that made a dead collector cost ~30 s at
    finish().  Each of our OTEL_TRACKING_MAX_ATTEMPTS attempts is one request, then the spool."""
    with RECEIVERS[protocol]() as receiver:
        receiver.received.unavailable = True
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_TRACKING_MAX_ATTEMPTS", "3")
        tracking = Tracking("proj", "exp", default_backend="file")
        tracking.log({"loss": 0.5}, step=1)
        stats = tracking.finish()
        assert receiver.received.refused["metrics"] == 3, receiver.received.refused
        assert stats["otlp-metrics"]["spooled"] == 1


class _StarvedClock:
    """``time`` for the SDK's OTLP/HTTP client in a process so starved that 11 s pass between any
    two of its readings of the clock (more than the 10 s timeout)."""

    def __init__(self) -> None:
        import time

        self._time, self.readings = time, 0

    def time(self) -> float:
        self.readings += 1
        return self._time.time() + 11.0 * self.readings

    def __getattr__(self, name: str) -> object:
        return getattr(self._time, name)


def test_a_request_gets_the_whole_timeout_however_long_the_batch_took_to_serialize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK hands the request what is left of the export's deadline, taken before the batch was
    serialized: in a starved process that was 0.0 s, which requests refuses ("Attempted to set
    connect timeout to 0.0"), and the export failed unsent."""
    import opentelemetry.exporter.otlp.proto.http.trace_exporter as trace_exporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from otel_tracking.compat.otel_sdk import one_try_per_export
    from otel_tracking.compat.otlp_failures import explain_failures

    with HttpReceiver() as receiver:
        exporter = OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")
        exporter = explain_failures(one_try_per_export(exporter))
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        clock = _StarvedClock()
        try:  # SDK 1.45+: the client shared by the HTTP exporters reads ``time.time()``
            import opentelemetry.exporter.otlp.common.http as http

            monkeypatch.setattr(http, "time", clock)
        except ImportError:  # older SDKs: the span exporter itself reads ``time()``
            monkeypatch.setattr(trace_exporter, "time", clock.time)
        with provider.get_tracer("t").start_as_current_span("rollout"):
            pass
        monkeypatch.undo()
        assert clock.readings >= 2  # the deadline was taken, then read again for the request
        assert [s["name"] for s in wait_for(receiver.received.spans, what="the span")] == ["rollout"]
        provider.shutdown()


NEVER_FINISHED = textwrap.dedent(
    """
    from otel_tracking import Tracking, trace_state

    tracking = Tracking("proj", "exp", default_backend="console")
    for step in range(1, 4):
        with trace_state("rollout"):
            pass
        tracking.log({"loss": 0.5}, step=step)
    # no finish(): the exit hook finishes the run
    """
)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_run_never_finished_against_a_dead_endpoint_says_why_once_and_sums_up(protocol: str, isolated: Path) -> None:
    """The exit hook's finish prints the summary finish() prints (per-sink counts, the replay
    command); each OTLP sink's first failure says why, once, with the endpoint's credentials
    scrubbed; the SDK's own "Failed to export ..." lines (one per attempt) are not printed."""
    from tests.conftest import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER")}
    env.update(OTEL_EXPORTER_OTLP_PROTOCOL=protocol, OTEL_TRACKING_FINISH_TIMEOUT="2")
    if protocol == "grpc":
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
        reason = {  # the SDK's words: 1.45's error line, or the warning of older ones (no details there)
            signal: rf"(Failed to export {signal} to 127\.0\.0\.1:{port}, error code: StatusCode\.UNAVAILABLE, "
            rf"error details: .*Connection refused|Transient error StatusCode\.UNAVAILABLE encountered while exporting "
            rf"{signal} to 127\.0\.0\.1:{port})"
            for signal in ("traces", "metrics")
        }
    else:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://alice:s3cr3t-pass@127.0.0.1:{port}"
        reason = {
            signal: rf"cannot connect to http://<redacted>@127\.0\.0\.1:{port}/v1/{signal} "
            r"\(Connection refused\)"
            for signal in ("traces", "metrics")
        }
    done = subprocess.run(
        [sys.executable, "-c", NEVER_FINISHED], cwd=isolated, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "s3cr3t-pass" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "not reachable now" not in line]
    spool = isolated / "spool" / "proj"
    (run_dir,) = spool.iterdir()
    expected = [
        rf"otel-tracking: sink 'otlp-traces' failed to export spans: OTLPExportError: {reason['traces']} "
        r"\(further failures are counted in the summary at the end\)",
        rf"otel-tracking: sink 'otlp-metrics' failed to export metrics: OTLPExportError: {reason['metrics']} "
        r"\(further failures are counted in the summary at the end\)",
        r"otel-tracking: otlp-metrics: 0 items delivered, 1 spooled, 0 dropped "
        r"\(items: log\(\) calls, spans, log records\); "
        r"\d+ exports failed, \d+ retried",
        r"otel-tracking: otlp-traces: 0 items delivered, 6 spooled, 0 dropped "
        r"\(items: log\(\) calls, spans, log records\); "
        r"\d+ exports failed, \d+ retried",
        r"otel-tracking: otlp-logs: 0 items delivered, 0 spooled, 0 dropped "
        r"\(items: log\(\) calls, spans, log records\); "
        r"0 exports failed, 0 retried",
        rf"otel-tracking: deliver the spooled data with: otel-tracking replay {re.escape(str(run_dir))}",
    ]
    assert len(lines) == len(expected), done.stderr
    # The two sinks' first failures happen on their own workers, in either order; the summary follows.
    warnings = [[line for line in lines[:2] if re.fullmatch(pattern, line)] for pattern in expected[:2]]
    assert [len(found) for found in warnings] == [1, 1], (lines[:2], expected[:2])
    for line, pattern in zip(lines[2:], expected[2:], strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)
