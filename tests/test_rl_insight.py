"""RLInsightLogger: the reference's class API on OTel spans and gauges, gated by VERL_RL_INSIGHT_ENABLE."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from otel_tracking import RLInsightLogger, Tracking
from tests.otlp_receiver import HttpReceiver, wait_for


@pytest.fixture(autouse=True)
def reset_logger():
    yield
    RLInsightLogger.finish()
    RLInsightLogger.registered_targets.clear()


def test_disabled_is_a_no_op(isolated: Path) -> None:
    assert not RLInsightLogger.enabled()
    RLInsightLogger.init("p", "e", {"trainer": {}})
    RLInsightLogger.log({"x": 1.0}, 1)
    with RLInsightLogger.trace_state("rollout", state_lane_id=0):
        pass
    RLInsightLogger.register_rollout_metrics(["127.0.0.1:8000"], "vllm")
    assert RLInsightLogger._run is None and RLInsightLogger.registered_targets == []
    tracking = Tracking("p", "e", default_backend=["rl_insight", "file"])
    tracking.log({"x": 1.0}, 1)
    assert set(tracking.finish()) == {"file"}


def test_enabled_exports_gauges_and_spans_over_otlp(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_RL_INSIGHT_ENABLE", "1")
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        RLInsightLogger("proj", "exp", config=None)
        with RLInsightLogger.trace_state("rollout", state_lane_id=3, engine="vllm"):
            with RLInsightLogger.trace_state("generate", state_lane_id=3):
                pass
        RLInsightLogger.log({"rollout/throughput": 123.5, "note": "not a number"}, step=2)
        RLInsightLogger.finish()
        gauges = wait_for(receiver.received.last_gauges, what="gauges")
        assert gauges["rollout/throughput"] == 123.5 and gauges["train.step"] == 2
        assert "note" not in gauges
        spans = {s["name"]: s for s in wait_for(receiver.received.spans, what="spans")}
        assert spans["generate"]["parent_span_id"] == spans["rollout"]["span_id"]
        assert spans["rollout"]["attributes"]["ml.lane"] == 3
        assert spans["rollout"]["attributes"]["ml.label.engine"] == "vllm"


def test_tracking_backend_shares_its_run(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_RL_INSIGHT_ENABLE", "1")
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("proj", "exp", default_backend=["rl_insight", "file"])
        assert RLInsightLogger._run is tracking._run
        tracking.log({"loss": 0.5}, 1)
        RLInsightLogger.log({"insight_only": 1.0}, 1)  # OTLP only, not the ML sinks
        tracking.finish()
        assert RLInsightLogger._run is None
        gauges = wait_for(receiver.received.last_gauges, what="gauges")
        assert gauges["loss"] == 0.5 and gauges["insight_only"] == 1.0
    lines = [json.loads(line) for line in (isolated / "proj" / "exp.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "data": {"loss": 0.5}}]


def test_register_metrics_writes_file_sd_targets_once(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_RL_INSIGHT_ENABLE", "1")
    targets = isolated / "targets"
    monkeypatch.setenv("OTEL_TRACKING_SCRAPE_TARGETS_DIR", str(targets))
    labels = [{"replica": "0"}, {"replica": "1"}]
    RLInsightLogger.register_rollout_metrics(["http://127.0.0.1:8001/", "127.0.0.1:8002"], "vllm", labels)
    RLInsightLogger.register_rollout_metrics(["http://127.0.0.1:8001/", "127.0.0.1:8002"], "vllm", labels)
    files = list(targets.glob("*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text()) == [
        {"targets": ["127.0.0.1:8001"], "labels": {"job": "vllm", "replica": "0"}},
        {"targets": ["127.0.0.1:8002"], "labels": {"job": "vllm", "replica": "1"}},
    ]
    assert len(RLInsightLogger.registered_targets) == 2


def test_insight_values_do_not_move_the_drivers_step(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``RLInsightLogger.log(data, step)`` went through ``Run.log``: after ``tracking.log(step=1)``
    and ``RLInsightLogger.log(step=500)`` the next phase was stamped step 501, and its step's root
    span had been ended (issue 19, item 10)."""
    from otel_tracking import trace_state

    monkeypatch.setenv("VERL_RL_INSIGHT_ENABLE", "1")
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("proj", "exp", default_backend=["rl_insight", "file"])
        tracking.log({"loss": 0.5}, 1)
        with trace_state("rollout"):
            RLInsightLogger.log({"rollout/throughput": 7.0}, 500)  # inside step 2's phase
        with trace_state("update"):
            pass
        tracking.log({"loss": 0.25}, 2)
        tracking.finish()
        gauges = wait_for(receiver.received.last_gauges, what="gauges")
        assert gauges["train.step"] == 2 and gauges["rollout/throughput"] == 7.0
        spans = wait_for(lambda: ((s := receiver.received.spans()) and len(s) >= 3 and s) or None, what="spans")
    by_name = {s["name"]: s for s in spans}
    assert by_name["rollout"]["attributes"]["ml.step"] == 2 and by_name["update"]["attributes"]["ml.step"] == 2
    roots = [s for s in spans if s["name"] == "ml.step"]
    assert len(roots) == 1 and roots[0]["attributes"]["ml.step"] == 2, "one root for step 2, ended by log(step=2)"
    assert by_name["rollout"]["parent_span_id"] == by_name["update"]["parent_span_id"] == roots[0]["span_id"]
    lines = [json.loads(line) for line in (isolated / "proj" / "exp.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "data": {"loss": 0.5}}, {"step": 2, "data": {"loss": 0.25}}]


def test_insight_values_before_any_step_are_exported_without_a_step(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VERL_RL_INSIGHT_ENABLE", "1")
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("proj", "exp", default_backend=["rl_insight"])
        RLInsightLogger.log({"warmup": 1.0}, 0)
        tracking.finish()
        gauges = wait_for(receiver.received.last_gauges, what="gauges")
    assert gauges == {"warmup": 1.0}


@pytest.mark.parametrize("how", ["own run", "Tracking backend"])
def test_without_an_endpoint_it_says_where_its_data_goes(
    how: str, isolated: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """rl_insight sends over OTLP even with no endpoint configured, to the OpenTelemetry default on
    localhost: one warning says so and where what cannot be delivered is kept (it said nothing)."""
    monkeypatch.setenv("VERL_RL_INSIGHT_ENABLE", "1")
    monkeypatch.setenv("OTEL_TRACKING_FINISH_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_TRACKING_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("OTEL_TRACKING_RUN_ID", "r1")
    if how == "own run":
        RLInsightLogger("proj", "exp")
        spool = isolated / "spool" / "proj" / "exp-r1" / f"worker-{_host()}-{os.getpid()}"
        RLInsightLogger.finish()
    else:
        Tracking("proj", "exp", default_backend=["rl_insight", "file"]).finish()
        spool = isolated / "spool" / "proj" / "exp-r1"
    said = [r.getMessage() for r in caplog.records if "rl_insight" in r.getMessage()]
    assert said == [
        "otel-tracking: rl_insight: no OTLP endpoint is configured (OTEL_EXPORTER_OTLP_ENDPOINT), so its traces, "
        "metrics and logs go to the OpenTelemetry default http://localhost:4318 (an agent or collector there: see "
        f"`otel-tracking stack`); what cannot be delivered is spooled in {spool}, for `otel-tracking replay`"
    ]


def test_with_an_endpoint_it_says_nothing_of_where(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VERL_RL_INSIGHT_ENABLE", "1")
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        RLInsightLogger("proj", "exp")
        RLInsightLogger.finish()
        Tracking("proj", "exp", default_backend=["rl_insight", "file"]).finish()
    assert [r.getMessage() for r in caplog.records if "no OTLP endpoint" in r.getMessage()] == []


def _host() -> str:
    import socket

    return socket.gethostname()
