"""The local stack end to end: real otelcol, Jaeger v2 and Prometheus on 127.0.0.1.

Telemetry is sent with the plain OpenTelemetry Python SDK over OTLP/HTTP and read back through
Jaeger's and Prometheus' HTTP APIs. Binaries are built on first use (several minutes) and
cached; a missing binary or toolchain fails these tests, it never skips them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from otel_tracking_stack.stack import Ports, Stack, ensure_binaries
from tests.stack_queries import jaeger_services, jaeger_traces, prom_alerts, prom_query

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")

SERVICE = f"otel-tracking-test-{uuid.uuid4().hex[:8]}"
RUN_ID = uuid.uuid4().hex[:12]
RESOURCE_ATTRS = {
    "service.name": SERVICE,
    "ml.project": "stack-test-project",
    "ml.experiment": "stack-test-experiment",
    "ml.run.id": RUN_ID,
}
LOSS = 0.8125  # exact in binary, so the text value in Prometheus is exact too
ENTROPY = 1.5
STEP = 7
LANES = [("rollout", 0), ("rollout", 1), ("reward", 0), ("reward", 1), ("update", 0)]
# (span_name, ml_lane) of every span a step sends: the step's root, its phase, the lanes
STEP_SPANS = {("ml.step", ""), ("train_step", ""), *((name, str(lane)) for name, lane in LANES)}


def poll(fn: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.25, what: str = "") -> T:
    """Call ``fn`` until it returns something truthy; fail with the last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = fn()
        except OSError as err:  # connection refused / reset while a program settles
            last = err
        if last and not isinstance(last, Exception):
            return last  # type: ignore[return-value]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")
        time.sleep(interval)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binaries = ensure_binaries()  # builds or reuses; raises (fails) when it cannot
    for name, path in binaries.items():
        assert path.exists() and (name == "zipkin" or os.access(path, os.X_OK)), path  # zipkin: a jar java runs
    st = Stack(
        tmp_path_factory.mktemp("stack"),
        Ports.free(),
        binaries=binaries,
        scrape_interval="1s",
        spanmetrics_flush="1s",
    )
    st.start()
    pids = {name: s["pid"] for name, s in st.status().items()}
    try:
        yield st
    finally:
        st.stop()
        for name, pid in pids.items():
            assert pid is not None
            alive = True
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            assert not alive, f"{name} (pid {pid}) still runs after stop()"


def _client_env(stack: Stack, root: Path) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": stack.otlp_http_endpoint,
        "OTEL_SERVICE_NAME": SERVICE,
        "OTEL_TRACKING_RUN_ID": RUN_ID,
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "VERL_FILE_LOGGER_ROOT": str(root),
    }


def _train_step(tracking: Any, step: int, loss: float) -> None:
    """One 'training step' through the facade: phases on lanes as spans, then the step's gauges."""
    from otel_tracking import trace_state

    with trace_state("train_step", step=step):
        for name, lane in LANES:
            with trace_state(name, state_lane_id=lane):
                time.sleep(0.005)  # a phase that lasts: non-zero durations in the span metrics
    tracking.log({"train/loss": loss, "actor/entropy": ENTROPY}, step)


def _span_calls(stack: Stack) -> dict[tuple[str, str], float]:
    """``traces_span_metrics_calls_total`` of this test's service in Prometheus, by (span, lane)."""
    result = prom_query(stack, f'traces_span_metrics_calls_total{{job="{SERVICE}"}}')
    return {(r["metric"]["span_name"], r["metric"].get("ml_lane", "")): float(r["value"][1]) for r in result}


def _scraped_steps(stack: Stack, rounds: int) -> dict[tuple[str, str], float] | None:
    """The span calls once Prometheus has scraped ``rounds`` steps' worth of every span, else None."""
    calls = _span_calls(stack)
    done = calls.keys() >= STEP_SPANS and all(calls[key] >= rounds for key in STEP_SPANS)
    return calls if done else None


@pytest.fixture(scope="module")
def sent(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """A run through the Tracking facade with OTEL_EXPORTER_OTLP_ENDPOINT at the collector: two
    steps, the second sent only once Prometheus has scraped every span series of the first, so
    that rate()/increase() over span metrics see a rise."""
    from otel_tracking import Tracking

    root = tmp_path_factory.mktemp("facade-run")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _client_env(stack, root).items():
            mp.setenv(key, value)
        tracking = Tracking(RESOURCE_ATTRS["ml.project"], RESOURCE_ATTRS["ml.experiment"], default_backend="file")
        _train_step(tracking, STEP - 1, 1.25)
        assert tracking.flush(30)
        poll(lambda: _scraped_steps(stack, 1), what=f"span metrics of every span of the first step: {STEP_SPANS}")
        _train_step(tracking, STEP, LOSS)
        stats = tracking.finish()
    assert all(counts["dropped"] == 0 and counts["spooled"] == 0 for counts in stats.values()), stats
    stack.file_sink = root / RESOURCE_ATTRS["ml.project"] / f"{RESOURCE_ATTRS['ml.experiment']}.jsonl"  # type: ignore[attr-defined]
    return stack


def test_status_reports_all_healthy(stack: Stack) -> None:
    status = stack.status()
    assert set(status) == {"jaeger", "collector", "prometheus", "zipkin", "trace_ui_relay"}
    for name, s in status.items():
        assert s["running"] and s["healthy"], (name, s)
        assert (stack.pid_dir / f"{name}.pid").read_text().strip() == str(s["pid"])


def test_trace_reaches_jaeger_with_links_and_attributes(sent: Stack) -> None:
    """One trace per step: the driver's step root span (``ml.step``), the phase under it, the lanes
    under the phase."""

    def find() -> dict[str, Any] | None:
        for trace in jaeger_traces(sent, SERVICE):
            spans = trace["spans"]
            phase = [s for s in spans if s["operationName"] == "train_step"]
            if (
                phase
                and len(spans) == 2 + len(LANES)
                and any(t["key"] == "ml.step" and t["value"] == STEP for t in phase[0]["tags"])
            ):
                return trace
        return None

    trace = poll(find, what=f"trace of step {STEP} in Jaeger")
    assert SERVICE in jaeger_services(sent)
    spans = {s["spanID"]: s for s in trace["spans"]}
    (root,) = [s for s in spans.values() if s["operationName"] == "ml.step"]
    (phase,) = [s for s in spans.values() if s["operationName"] == "train_step"]
    assert not root.get("references")
    assert _tag(root, "ml.step") == STEP  # the step log() closed
    assert phase["references"] == [{"refType": "CHILD_OF", "traceID": trace["traceID"], "spanID": root["spanID"]}]
    children = [s for s in spans.values() if s is not root and s is not phase]
    assert sorted((s["operationName"], _tag(s, "ml.lane")) for s in children) == sorted(LANES)
    for child in children:
        refs = child["references"]
        assert refs == [{"refType": "CHILD_OF", "traceID": trace["traceID"], "spanID": phase["spanID"]}]
        assert child["startTime"] >= phase["startTime"]
        assert child["startTime"] + child["duration"] <= phase["startTime"] + phase["duration"]
    process = trace["processes"][root["processID"]]
    assert process["serviceName"] == SERVICE
    proc_tags = {t["key"]: t["value"] for t in process["tags"]}
    for key in ("ml.project", "ml.experiment", "ml.run.id"):
        assert proc_tags[key] == RESOURCE_ATTRS[key]
    assert proc_tags["ml.run.attempt"] == 1  # a resumed run's spans say their attempt (docs/guides/resume.md)


def _tag(span: dict[str, Any], key: str) -> Any:
    return next(t["value"] for t in span["tags"] if t["key"] == key)


def test_gauges_reach_prometheus_with_resource_labels(sent: Stack) -> None:
    expr = f'train_loss{{ml_run_id="{RUN_ID}"}}'
    result = poll(
        lambda: [r for r in prom_query(sent, expr) if float(r["value"][1]) == LOSS],
        what=f"{expr} == {LOSS}",
    )
    assert len(result) == 1
    labels = result[0]["metric"]
    assert labels["__name__"] == "train_loss"
    assert labels["job"] == SERVICE  # service.name, kept by honor_labels
    assert labels["ml_project"] == RESOURCE_ATTRS["ml.project"]
    assert labels["ml_experiment"] == RESOURCE_ATTRS["ml.experiment"]
    assert labels["ml_run_id"] == RUN_ID
    assert labels["ml_run_attempt"] == "1"  # attempts of a resumed run are separate series
    assert result[0]["value"][1] == "0.8125"
    step = poll(
        lambda: [r for r in prom_query(sent, f'train_step{{ml_run_id="{RUN_ID}"}}') if r["value"][1] == str(STEP)],
        what=f"train_step == {STEP}",
    )
    assert step[0]["metric"]["ml_experiment"] == RESOURCE_ATTRS["ml.experiment"]


def test_span_metrics_carry_lane_and_phase(sent: Stack) -> None:
    expr = f'traces_span_metrics_calls_total{{job="{SERVICE}", ml_lane!=""}}'

    def both_rounds() -> list[dict[str, Any]] | None:
        result = prom_query(sent, expr)
        # one call per (phase, lane) and round: every series reaches 2
        return result if result and all(float(r["value"][1]) >= 2 for r in result) else None

    result = poll(both_rounds, what="span metrics of both rounds")
    seen = {(r["metric"]["span_name"], r["metric"]["ml_lane"]) for r in result}
    assert seen == {(name, str(lane)) for name, lane in LANES}
    assert all(r["metric"]["ml_run_id"] == RUN_ID for r in result)


def test_the_file_sink_still_has_every_step(sent: Stack) -> None:
    import json

    lines = [json.loads(line) for line in sent.file_sink.read_text().splitlines()]  # type: ignore[attr-defined]
    assert lines == [
        {"step": STEP - 1, "data": {"train/loss": 1.25, "actor/entropy": ENTROPY}},
        {"step": STEP, "data": {"train/loss": LOSS, "actor/entropy": ENTROPY}},
    ]


def test_register_rollout_metrics_reaches_prometheus(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A /metrics endpoint (prometheus_client, standing in for a vLLM server) registered through
    the reference API shows up in Prometheus with its labels."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    from otel_tracking import RLInsightLogger

    registry = CollectorRegistry()
    gauge = Gauge("vllm_num_requests_waiting", "stand-in for a vLLM metric", ["model_name"], registry=registry)
    gauge.labels(model_name="tiny-rollout-model").set(5)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    monkeypatch.setenv("VERL_RL_INSIGHT_ENABLE", "1")
    monkeypatch.setenv("OTEL_TRACKING_SCRAPE_TARGETS_DIR", str(stack.targets_dir))
    try:
        port = server.server_address[1]
        RLInsightLogger.register_rollout_metrics(
            [f"http://127.0.0.1:{port}/"], "vllm-rollout", [{"ml_run_id": RUN_ID, "replica": "0"}]
        )
        expr = f'vllm_num_requests_waiting{{model_name="tiny-rollout-model", ml_run_id="{RUN_ID}"}}'
        result = poll(lambda: prom_query(stack, expr), what=expr)
        labels = result[0]["metric"]
        assert result[0]["value"][1] == "5"
        assert labels["job"] == "vllm-rollout" and labels["replica"] == "0"
        assert labels["instance"] == f"127.0.0.1:{port}"
    finally:
        RLInsightLogger.finish()
        stack.remove_scrape_target("vllm-rollout")
        server.shutdown()
        thread.join(5)


STALLED = """
import os, sys, threading
from otel_tracking import Tracking, trace_state

t = Tracking("stall-project", "stall-experiment", default_backend=["file"])
with trace_state("update_actor", step=3):
    while not os.path.exists(sys.argv[1]):
        threading.Event().wait(0.05)
t.log({"loss": 1.0}, 3)
t.finish()
"""


def test_a_stalled_phase_fires_the_prometheus_alert_while_it_is_stuck(stack: Stack, tmp_path: Path) -> None:
    """Issue 32: the gauges ml.phase.open and ml.phase.stall_bound reach Prometheus, and the rule
    the stack loads (deploy/prometheus/stall-rules.yaml) fires for the stuck rank's phase."""
    import subprocess

    flag = tmp_path / "come-back"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env.update(_client_env(stack, tmp_path))
    env.update(OTEL_TRACKING_STALL_AFTER="2", RANK="3", OTEL_TRACKING_ROLE="actor", OTEL_TRACKING_RUN_ID="stall-run")
    env["OTEL_SERVICE_NAME"] = f"{SERVICE}-stall"  # not the module's run: its span metrics are counted exactly
    env["OTEL_TRACKING_SPOOL_DIR"] = str(tmp_path / "spool")
    child = subprocess.Popen([sys.executable, "-c", STALLED, str(flag)], env=env, cwd=tmp_path, stderr=subprocess.PIPE)

    def firing() -> dict[str, Any] | None:
        for alert in prom_alerts(stack):
            labels = alert["labels"]
            if alert["state"] == "firing" and labels.get("ml_run_id") == "stall-run":
                return alert
        return None

    try:
        alert = poll(firing, timeout=60, what="the PhaseStalled alert firing")
        assert child.poll() is None, "it fired while the phase was stuck"
        bound = prom_query(stack, 'ml_phase_stall_bound_seconds{ml_run_id="stall-run"}')
    finally:
        flag.touch()
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    labels = alert["labels"]
    assert labels["alertname"] == "PhaseStalled" and labels["ml_phase"] == "update_actor"
    assert (labels["ml_rank"], labels["ml_role"], labels["process_pid"]) == ("3", "actor", str(child.pid))
    assert float(alert["value"]) > 2.0
    assert (
        "actor rank 3" in alert["annotations"]["summary"]
        and "phase update_actor open" in alert["annotations"]["summary"]
    )
    assert [float(r["value"][1]) for r in bound] == [2.0]


def test_file_sd_scrape_target_reaches_prometheus(stack: Stack) -> None:
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    gauge = Gauge("vllm_num_requests_running", "stand-in for a vLLM server metric", ["model_name"], registry=registry)
    gauge.labels(model_name="tiny-test-model").set(3)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        path = stack.write_scrape_target("vllm-rollout", [f"127.0.0.1:{port}"], {"ml_run_id": RUN_ID, "engine": "vllm"})
        assert path.parent == stack.targets_dir and path.suffix == ".json"
        expr = f'vllm_num_requests_running{{model_name="tiny-test-model", ml_run_id="{RUN_ID}"}}'
        result = poll(lambda: prom_query(stack, expr), what=expr)
        labels = result[0]["metric"]
        assert result[0]["value"][1] == "3"
        assert labels["job"] == "vllm-rollout"
        assert labels["engine"] == "vllm"
        assert labels["instance"] == f"127.0.0.1:{port}"
    finally:
        stack.remove_scrape_target("vllm-rollout")
        server.shutdown()
        thread.join(5)


def _panel_queries_module() -> Any:
    path = REPO / "otel_tracking_stack" / "deploy" / "grafana" / "panel_queries.py"
    spec = importlib.util.spec_from_file_location("otel_tracking_panel_queries", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_grafana_panel_query_returns_data(sent: Stack) -> None:
    pq = _panel_queries_module()
    variables = {
        "service": SERVICE,
        "ml_project": RESOURCE_ATTRS["ml.project"],
        "ml_experiment": RESOURCE_ATTRS["ml.experiment"],
        "ml_run_id": RUN_ID,
    }
    queries = pq.all_queries(variables=variables)
    assert len(queries) >= 10
    kinds = {q.panel_type for q in queries}
    assert {"timeseries", "state-timeline", "xychart", "bargauge"} <= kinds

    def finite(result: list[dict[str, Any]]) -> bool:
        return any(math.isfinite(float(r["value"][1])) for r in result)

    # Everything the run sent is in Prometheus: both steps' span metrics (the durations come in the
    # same scrape as the calls) and the last step's gauges. From then on every panel must answer.
    poll(lambda: _scraped_steps(sent, 2), what="span metrics of both steps")
    poll(
        lambda: prom_query(sent, f'train_step{{ml_run_id="{RUN_ID}"}} == {STEP}'),
        what=f"train_step == {STEP}",
    )
    empty = [q for q in queries if not finite(prom_query(sent, q.query))]
    assert not empty, "panels without data: " + "; ".join(f"{q.panel_title}: {q.query}" for q in empty)

    # the lane timeline maps phases to values 1..3: each lane shows a known phase
    (lane_q,) = [q for q in queries if q.panel_type == "state-timeline"]
    lanes = {r["metric"]["ml_lane"]: float(r["value"][1]) for r in prom_query(sent, lane_q.query)}
    assert set(lanes) == {"0", "1"}
    assert all(v in (1.0, 2.0, 3.0) for v in lanes.values()), lanes
    # the template variables' label_values(selector, label) find this run
    dashboard = REPO / "otel_tracking_stack" / "deploy" / "grafana" / "dashboards" / "otel-tracking-training.json"
    expected = {"job": SERVICE, **{k: variables[k] for k in ("ml_project", "ml_experiment", "ml_run_id")}}
    var_queries = pq.variable_queries(dashboard)
    assert len(var_queries) == 4
    for var_query in var_queries:
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var_query)
        assert m, var_query
        selector, label = pq.render(m.group(1), variables), m.group(2)
        values = {r["metric"].get(label) for r in prom_query(sent, f"count by ({label}) ({selector})")}
        assert expected[label] in values, (var_query, values)


def test_cli_status_of_a_stopped_stack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from otel_tracking_stack.stack import main

    assert main(["--state-dir", str(tmp_path), "status"]) == 3
    out = capsys.readouterr().out
    assert out.count("stopped") == 5
    assert main(["--state-dir", str(tmp_path), "down"]) == 0


def test_cli_up_status_down(tmp_path: Path) -> None:
    """`otel-tracking stack up` starts all five detached and prints what to export; `status` sees
    them healthy; `down` stops them by their pid files."""
    import subprocess

    state = tmp_path / "state"
    cli = [sys.executable, "-m", "otel_tracking", "stack"]
    up = subprocess.run(
        [*cli, "up", "--state-dir", str(state), "--free-ports"], capture_output=True, text=True, timeout=180
    )
    try:
        assert up.returncode == 0, up.stderr
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in up.stdout.splitlines()
            if line.startswith("export ") and "=" in line
        )
        assert exports["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://127.0.0.1:")
        assert Path(exports["OTEL_TRACKING_SCRAPE_TARGETS_DIR"]).is_dir()
        assert exports["OTEL_METRIC_EXPORT_INTERVAL"] == "1000"  # curves in Prometheus, not one point a minute
        assert "jaeger_api" in up.stdout and "/api/traces?service=" in up.stdout
        # the trace UI's address, and the variable that makes each run's summary link to it
        trace_ui = re.search(r"^\s+trace_ui\s+(http://127\.0\.0\.1:\d+/zipkin/)$", up.stdout, re.M)
        assert trace_ui, up.stdout
        assert exports["OTEL_TRACKING_TRACES_URL"] == trace_ui.group(1)
        status = subprocess.run([*cli, "status", "--state-dir", str(state)], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("healthy") == 5
        assert re.search(r"^  trace UI\s+http://127\.0\.0\.1:\d+/zipkin/$", status.stdout, re.M), status.stdout
        again = subprocess.run(
            [*cli, "up", "--state-dir", str(state), "--free-ports"], capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        down = subprocess.run([*cli, "down", "--state-dir", str(state)], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    after = subprocess.run([*cli, "status", "--state-dir", str(state)], capture_output=True, text=True, timeout=60)
    assert after.returncode == 3 and after.stdout.count("stopped") == 5


WORKER = """
import os, time
from otel_tracking import trace_state
rank = int(os.environ["RANK"])
with trace_state("actor_update", state_lane_id=f"rank_{rank}"):
    time.sleep(0.6 if rank == 1 else 0.2)
"""

DRIVER = """
import os, subprocess, sys
from otel_tracking import Tracking, trace_state
from otel_tracking.distributed.propagation import context_env
t = Tracking("timeline-proj", "timeline-exp", default_backend="file")
for step in (1, 2):
    with trace_state("update_actor"):
        env = {**os.environ, **context_env(), "OTEL_TRACKING_ROLE": "actor"}
        workers = [subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**env, "RANK": str(r)}) for r in (0, 1)]
        assert all(w.wait() == 0 for w in workers)
    t.log({"loss": 1.0 / step}, step)
t.finish()
"""


def test_the_timeline_draws_the_workers_that_export_only_over_otlp_from_the_trace_ui(
    stack: Stack, tmp_path: Path
) -> None:
    """Worker processes without ``Tracking`` (spans over OTLP only, to the stack's collector) drawn
    by ``otel-tracking timeline`` beside the driver's events file, from the stack's trace store
    (Zipkin's API, fed by the collector through the relay)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=stack.otlp_http_endpoint,
        OTEL_SERVICE_NAME="timeline-test",
        OTEL_TRACKING_SPOOL_DIR=str(tmp_path / "spool"),
        VERL_FILE_LOGGER_ROOT=str(tmp_path),
    )
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, WORKER], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    run_id = next(
        json.loads(line)["resource"]["ml.run.id"]
        for line in (tmp_path / "timeline-proj" / "timeline-exp.events.jsonl").read_text().splitlines()
    )
    api = stack.trace_ui_url.replace("/zipkin/", "/api/v2/traces?annotationQuery=ml.run.id%3D") + run_id

    def both_steps_in_zipkin() -> list[Any] | None:
        with urllib.request.urlopen(api, timeout=10) as answer:
            spans = [s for trace in json.load(answer) for s in trace]
        return spans if sum(s["name"] == "actor_update" for s in spans) >= 4 else None

    poll(both_steps_in_zipkin, timeout=120, what="the workers' spans in Zipkin")
    timeline = [sys.executable, "-m", "otel_tracking", "timeline", "timeline-proj", "--steps", "2", "--out", "step2"]
    drawn = subprocess.run(
        [*timeline, "--traces-url", stack.trace_ui_url],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert drawn.returncode == 0, drawn.stderr
    assert "on 3 lanes, step 2" in drawn.stdout, drawn.stdout
    # rank 1 took 0.4 s longer; with two ranks, the median end is half way between them (each
    # worker's interpreter start is in its lag too: a range)
    lag = re.search(r"straggler: step 2 update_actor: actor rank 1 / lane rank_1, \+([\d.]+) s", drawn.stdout)
    assert lag and 0.05 <= float(lag.group(1)) <= 0.6, drawn.stdout
    events = json.loads((tmp_path / "step2.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {"driver", "actor rank 0 / lane rank_0", "actor rank 1 / lane rank_1"}
    # without the trace UI, the events file alone has only the driver's lane
    alone = subprocess.run([*timeline[:-2], "--out", "alone"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert "on 1 lanes, step 2" in alone.stdout, alone.stdout
