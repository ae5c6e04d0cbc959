"""A multi-node run on loopback: worker processes -> node agent -> gateway -> Jaeger and Prometheus.

The gateway is the stack's collector (``collector-config.yaml``); the agent is the same otelcol
binary with ``deploy/collector/agent.yaml``, forwarding over OTLP/gRPC. The test process plays the
verl driver: a ``Tracking`` whose step root span (``ml.step``) is the parent of worker
subprocesses that never build a ``Tracking``: they continue the trace from the W3C ``TRACEPARENT``
environment variable with ``trace_state`` and send a gauge with ``RLInsightLogger``, over OTLP/HTTP
to the agent (a second worker, the plain OpenTelemetry SDK, shows any OTel app works the same).
Everything is read back through Jaeger's and Prometheus' HTTP APIs. A second test stops the
gateway while workers send, restarts it on the same ports, and finds everything the agent queued.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from otel_tracking.signals.ids import ID_GENERATOR
from otel_tracking_stack.stack import AGENT_CONFIG, Agent, AgentPorts, Ports, Stack, ensure_binaries
from tests.stack_queries import jaeger_traces, prom_query
from tests.test_stack import poll

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parent.parent
RUN_ID = uuid.uuid4().hex[:12]
DRIVER_SERVICE = f"verl-driver-{RUN_ID}"
WORKER_SERVICE = f"verl-worker-{RUN_ID}"
NODE = "node-a"  # what the agent stamps as ml.node
RANKS = (0, 1, 2)
STEPS = (1, 2)
OUTAGE_STEP = 3
GAUGE = "worker.tokens_per_s"  # in Prometheus: worker_tokens_per_s


def gauge_value(rank: int, step: int) -> float:
    return 100.0 * (rank + 1) + step  # exact in binary and in Prometheus' text


# --------------------------------------------------------------------------- the worker (the seam)
#
# WORKER names the function each worker process runs. The contract, so that it can be swapped for
# otel_tracking's own worker API (``trace_state`` in a process without ``Tracking``):
#   in:  OTEL_EXPORTER_OTLP_ENDPOINT (the agent, OTLP/HTTP), OTEL_SERVICE_NAME, OTEL_TRACKING_RUN_ID,
#        RANK, ML_STEP, TRACEPARENT (W3C, the driver's step span);
#   out: a span "rollout" whose parent is TRACEPARENT, with a child "generate"; the gauge GAUGE
#        = gauge_value(rank, step); resource service.name, ml.run.id, ml.rank, host.name, process.pid;
#        everything exported before the process exits;
#   stdout, last line: {"rank", "pid", "trace_id", "spans": {"rollout": hex, "generate": hex}}.
WORKER = "tests.test_agent_gateway:otel_tracking_worker"


def otel_tracking_worker() -> None:
    """One worker process with otel-tracking's own API, as a verl worker actor runs it: no Tracking;
    the first trace_state builds the process's worker run from the environment (see the contract)."""
    import random

    random.seed(0)
    os.environ["VERL_RL_INSIGHT_ENABLE"] = "1"  # RLInsightLogger gauges, as verl's workers send them

    from otel_tracking import RLInsightLogger, trace_state

    rank, step = int(os.environ["RANK"]), int(os.environ["ML_STEP"])
    with trace_state("rollout", state_lane_id=f"rank_{rank}", step=step) as rollout:
        with trace_state("generate") as generate:
            RLInsightLogger.log({GAUGE: gauge_value(rank, step)}, step)
    ctx = rollout.get_span_context()
    report = {
        "rank": rank,
        "pid": os.getpid(),
        "trace_id": f"{ctx.trace_id:032x}",
        "spans": {"rollout": f"{ctx.span_id:016x}", "generate": f"{generate.get_span_context().span_id:016x}"},
    }
    print(json.dumps(report), flush=True)  # the runs are flushed at exit


def plain_sdk_worker() -> None:
    """One worker process with the plain OpenTelemetry SDK (see the contract above)."""
    import random

    random.seed(0)  # what every worker of an RL job does; the span ids must still be distinct

    from opentelemetry import propagate
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    rank, step = int(os.environ["RANK"]), int(os.environ["ML_STEP"])
    resource = Resource.create(
        {
            "service.name": os.environ["OTEL_SERVICE_NAME"],
            "ml.run.id": os.environ["OTEL_TRACKING_RUN_ID"],
            "ml.rank": rank,
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
        }
    )
    # the exporters read OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/traces, /v1/metrics): nothing else is set
    spans = TracerProvider(resource=resource, id_generator=ID_GENERATOR, shutdown_on_exit=False)
    spans.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=3_600_000)
    meters = MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)

    parent = propagate.extract({"traceparent": os.environ["TRACEPARENT"]})
    tracer = spans.get_tracer("worker")
    with tracer.start_as_current_span("rollout", context=parent, attributes={"ml.step": step}) as rollout:
        with tracer.start_as_current_span("generate") as generate:
            meters.get_meter("worker").create_gauge(GAUGE).set(gauge_value(rank, step))
    meters.shutdown()  # exports the gauge
    spans.shutdown()
    ctx = rollout.get_span_context()
    ids = {"rollout": ctx.span_id, "generate": generate.get_span_context().span_id}
    report = {
        "rank": rank,
        "pid": os.getpid(),
        "trace_id": f"{ctx.trace_id:032x}",
        "spans": {k: f"{v:016x}" for k, v in ids.items()},
    }
    print(json.dumps(report), flush=True)


def run_workers(
    agent: Agent, step: int, ranks: Sequence[int], traceparent: str, worker: str = WORKER
) -> dict[int, dict[str, Any]]:
    """Start one worker process per rank, all at once, and wait for them; their reports by rank."""
    module, func = worker.split(":")
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from {module} import {func}; {func}()"
    procs: dict[int, subprocess.Popen[str]] = {}
    try:
        for rank in ranks:
            env = {
                **os.environ,
                **agent.client_env(),
                "OTEL_SERVICE_NAME": WORKER_SERVICE,
                "OTEL_TRACKING_RUN_ID": RUN_ID,
                "RANK": str(rank),
                "ML_STEP": str(step),
                "TRACEPARENT": traceparent,
            }
            procs[rank] = subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        reports = {}
        for rank, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"worker {rank} exited with {proc.returncode}:\n{err}"
            reports[rank] = json.loads(out.strip().splitlines()[-1])
        return reports
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# --------------------------------------------------------------------------- the driver


class Driver:
    """The test process as the verl driver: a Tracking whose OTLP goes to the agent; each step's
    root span (``ml.step``) is the parent of the workers' spans, and each step ends with a log()
    and a validation-generations event (a log record)."""

    def __init__(self, agent: Agent, worker: str = WORKER) -> None:
        from otel_tracking import Tracking

        self.env = pytest.MonkeyPatch()
        for key, value in {
            **agent.client_env(),
            "OTEL_SERVICE_NAME": DRIVER_SERVICE,
            "OTEL_TRACKING_RUN_ID": RUN_ID,
            "OTEL_METRIC_EXPORT_INTERVAL": "500",
        }.items():
            self.env.setenv(key, value)
        self.tracking = Tracking("agent-gateway", "chain", default_backend="file")
        self.agent = agent
        self.worker = worker

    def step(self, step: int, ranks: Sequence[int]) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """Workers under the step's root span (their parent through TRACEPARENT); ids and reports."""
        from otel_tracking import ValidationGenerationsLogger
        from otel_tracking.distributed.propagation import inject

        carrier = inject()  # outside any span: the step's root span
        reports = run_workers(self.agent, step, ranks, carrier["traceparent"], self.worker)
        ValidationGenerationsLogger().log(["file"], [["q", "a", 1.0]], step)
        self.tracking.log({"driver.step_done": 1.0}, step)  # closes the step's root span
        _, trace_id, span_id, _ = carrier["traceparent"].split("-")
        return {"trace_id": trace_id, "span_id": span_id}, reports

    def shutdown(self) -> None:
        self.tracking.finish()
        self.env.undo()


# --------------------------------------------------------------------------- fixtures


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def binaries() -> dict[str, Path]:
    return ensure_binaries()  # builds or reuses; raises (fails) when it cannot


@pytest.fixture(scope="module")
def stack(binaries: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The gateway (the stack's collector) with Jaeger and Prometheus, on free ports."""
    st = Stack(tmp_path_factory.mktemp("gateway"), Ports.free(), binaries=binaries, scrape_interval="1s")
    st.start()
    try:
        yield st
    finally:
        pids = {name: s["pid"] for name, s in st.status().items() if s["pid"] is not None}
        st.stop()
        for name, pid in pids.items():
            assert _gone(pid), f"{name} (pid {pid}) still runs after stop()"


@pytest.fixture(scope="module")
def agent(stack: Stack, binaries: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    ag = Agent(
        tmp_path_factory.mktemp("agent"),
        stack.gateway_endpoint,
        AgentPorts.free(),
        binary=binaries["collector"],
        node_name=NODE,
    )
    ag.start()
    pid = ag.pid
    assert pid is not None
    try:
        yield ag
    finally:
        ag.stop()
        assert _gone(pid), f"agent (pid {pid}) still runs after stop()"


# --------------------------------------------------------------------------- reading back


def _tags(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {t["key"]: t["value"] for t in items}


def _find_trace(stack: Stack, trace_id: str) -> dict[str, Any] | None:
    """The trace from Jaeger, as far as it arrived (Jaeger may drop leading zeros of ids)."""
    for trace in jaeger_traces(stack, DRIVER_SERVICE):
        if int(trace["traceID"], 16) == int(trace_id, 16):
            return trace
    return None


def wait_for_trace(stack: Stack, trace_id: str, n_spans: int, what: str) -> dict[str, Any]:
    """Poll Jaeger until the trace has ``n_spans`` spans; on timeout, say which spans it has."""
    seen: list[str] | None = None

    def complete() -> dict[str, Any] | None:
        nonlocal seen
        trace = _find_trace(stack, trace_id)
        seen = sorted(s["operationName"] for s in trace["spans"]) if trace else None
        return trace if trace and len(trace["spans"]) >= n_spans else None

    try:
        return poll(complete, what=what)
    except pytest.fail.Exception:
        pytest.fail(f"{what}: wanted {n_spans} spans in trace {trace_id}; Jaeger has {seen}")


def check_trace(
    trace: dict[str, Any], step: int, root_ids: dict[str, Any], reports: dict[int, dict[str, Any]]
) -> list[int]:
    """The driver's step span is the root, each worker's rollout its child and each generate the
    child of that worker's rollout; resources carry rank, run id, host, pid and the agent's node.
    Returns the trace's span ids."""
    spans = trace["spans"]
    processes = trace["processes"]
    assert len(spans) == 1 + 2 * len(reports), [s["operationName"] for s in spans]
    by_id = {int(s["spanID"], 16): s for s in spans}
    assert len(by_id) == len(spans), "duplicate span ids in one trace"

    (root,) = [s for s in spans if s["operationName"] == "ml.step"]
    assert int(root["spanID"], 16) == int(root_ids["span_id"], 16)
    assert not root.get("references")
    assert _tags(root["tags"])["ml.step"] == step
    driver = processes[root["processID"]]
    assert driver["serviceName"] == DRIVER_SERVICE
    assert _tags(driver["tags"])["ml.node"] == NODE

    for rank, report in reports.items():
        assert int(report["trace_id"], 16) == int(root_ids["trace_id"], 16), "worker did not continue the trace"
        rollout = by_id[int(report["spans"]["rollout"], 16)]
        generate = by_id[int(report["spans"]["generate"], 16)]
        assert (rollout["operationName"], generate["operationName"]) == ("rollout", "generate")
        assert [(r["refType"], int(r["spanID"], 16)) for r in rollout["references"]] == [
            ("CHILD_OF", int(root["spanID"], 16))
        ]
        assert [(r["refType"], int(r["spanID"], 16)) for r in generate["references"]] == [
            ("CHILD_OF", int(rollout["spanID"], 16))
        ]
        assert rollout["processID"] == generate["processID"]
        process = processes[rollout["processID"]]
        assert process["serviceName"] == WORKER_SERVICE
        tags = _tags(process["tags"])
        assert tags["ml.rank"] == rank
        assert tags["ml.run.id"] == RUN_ID
        assert tags["process.pid"] == report["pid"]
        assert tags["host.name"] == socket.gethostname()
        assert tags["ml.node"] == NODE  # added by the agent: the spans went through it
    return list(by_id)


def _gauges(stack: Stack, reports_by_step: dict[int, dict[int, dict[str, Any]]]) -> list[dict[str, Any]] | None:
    """The workers' gauge series in Prometheus, once there is one for each of these worker processes."""
    pids = {str(report["pid"]) for reports in reports_by_step.values() for report in reports.values()}
    result = prom_query(stack, f'worker_tokens_per_s{{ml_run_id="{RUN_ID}"}}')
    result = [r for r in result if r["metric"].get("process_pid") in pids]
    return result if len(result) >= len(pids) else None


def check_gauges(result: list[dict[str, Any]], reports_by_step: dict[int, dict[int, dict[str, Any]]]) -> None:
    """One series per worker process, labelled with its rank, pid and node, with its value."""
    got = {(r["metric"]["ml_rank"], r["metric"]["process_pid"]): r["value"][1] for r in result}
    expected = {
        (str(rank), str(report["pid"])): f"{gauge_value(rank, step):g}"
        for step, reports in reports_by_step.items()
        for rank, report in reports.items()
    }
    assert got == expected
    for r in result:
        labels = r["metric"]
        assert labels["job"] == WORKER_SERVICE
        assert labels["ml_node"] == NODE
        assert labels["host_name"] == socket.gethostname()


# --------------------------------------------------------------------------- tests


def test_workers_continue_the_driver_trace_through_agent_and_gateway(stack: Stack, agent: Agent) -> None:
    driver = Driver(agent)
    try:
        steps = {step: driver.step(step, RANKS) for step in STEPS}
    finally:
        driver.shutdown()

    all_span_ids: list[int] = []
    for step, (root_ids, reports) in steps.items():
        trace = wait_for_trace(stack, root_ids["trace_id"], 1 + 2 * len(RANKS), f"the trace of step {step}")
        all_span_ids += check_trace(trace, step, root_ids, reports)
    # one trace per step, and no span id twice across workers and steps, though every worker seeded 0
    assert len({int(root["trace_id"], 16) for root, _ in steps.values()}) == len(STEPS)
    assert len(set(all_span_ids)) == len(all_span_ids) == len(STEPS) * (1 + 2 * len(RANKS))

    reports_by_step = {step: reports for step, (_, reports) in steps.items()}
    result = poll(lambda: _gauges(stack, reports_by_step), what="worker_tokens_per_s of every worker")
    check_gauges(result, reports_by_step)

    # the driver's log records went the same way (the gateway sends logs to its debug exporter)
    poll(
        lambda: agent.self_metrics().get("otelcol_exporter_sent_log_records", 0) >= len(STEPS),
        what="the agent forwarding the driver's log records",
    )


def test_agent_queue_holds_everything_while_the_gateway_restarts(stack: Stack, agent: Agent) -> None:
    """Stop the gateway, run a step whose workers send to the agent, check the agent holds the data
    and retries, restart the gateway on the same ports: everything arrives, nothing was dropped."""
    ranks = (0, 1)
    log_offset = agent.log_path.stat().st_size
    stack.stop_program("collector")
    try:
        assert not stack.status()["collector"]["running"]
        driver = Driver(agent, worker="tests.test_agent_gateway:plain_sdk_worker")  # any OTel app, too
        try:
            root_ids, reports = driver.step(OUTAGE_STEP, ranks)
        finally:
            driver.shutdown()

        def held_and_retrying() -> bool:
            retrying = "Exporting failed. Will retry" in agent.log_path.read_text(errors="replace")[log_offset:]
            return retrying and agent.self_metrics().get("otelcol_exporter_queue_size", 0) > 0

        poll(held_and_retrying, what="the agent queueing and retrying while the gateway is down")
        assert _find_trace(stack, root_ids["trace_id"]) is None  # nothing got past the agent
    finally:
        stack.start_program("collector")  # same ports; the agent reconnects on its own

    trace = wait_for_trace(stack, root_ids["trace_id"], 1 + 2 * len(ranks), "the spans sent during the outage")
    check_trace(trace, OUTAGE_STEP, root_ids, reports)
    result = poll(lambda: _gauges(stack, {OUTAGE_STEP: reports}), what="the gauges sent during the outage")
    check_gauges(result, {OUTAGE_STEP: reports})

    metrics = poll(
        lambda: (m := agent.self_metrics()).get("otelcol_exporter_queue_size", 1) == 0 and m,
        what="the agent's queue to drain",
    )
    for signal in ("spans", "metric_points", "log_records"):
        assert metrics.get(f"otelcol_exporter_send_failed_{signal}", 0) == 0, metrics
        assert metrics.get(f"otelcol_exporter_enqueue_failed_{signal}", 0) == 0, metrics


def _listening(port: int) -> set[str]:
    """Where a socket listens at ``port``: "127.0.0.1", or "all" for 0.0.0.0 and [::] (Go listens
    on a dual-stack [::] socket for 0.0.0.0), from ``/proc/net/tcp`` and ``tcp6`` (state 0A)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:
                continue
            if set(address) == {"0"}:
                found.add("all")
            elif address in ("0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"):
                found.add("127.0.0.1")
            else:
                found.add(address)
    return found


def test_gateway_mode_opens_only_the_collectors_otlp_ports(tmp_path: Path, binaries: dict[str, Path]) -> None:
    """`stack up --gateway`: the real collector listens for the agents of other nodes on all
    interfaces with its OTLP receivers only; its Prometheus exporter (every run's metrics,
    unauthenticated) and health port stay on loopback, as Jaeger and Prometheus do."""
    gateway = Stack(tmp_path, Ports.free(), collector_host="0.0.0.0")
    assert gateway.program_env("jaeger")["OTEL_TRACKING_HOST"] == "127.0.0.1"
    log = tmp_path / "collector.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(binaries["collector"]), "--config", str(gateway.collector_config)],
            env=gateway.program_env("collector"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        ports = gateway.ports
        poll(lambda: _listening(ports.collector_health), 60, what="the collector's health port")
        poll(lambda: _listening(ports.prom_exporter), 60, what="the collector's exporter")
        poll(lambda: _listening(ports.otlp_http), 60, what="the collector's OTLP/HTTP receiver")
        assert _listening(ports.otlp_grpc) == {"all"} and _listening(ports.otlp_http) == {"all"}
        assert _listening(ports.prom_exporter) == {"127.0.0.1"}
        assert _listening(ports.collector_health) == {"127.0.0.1"}
    finally:
        process.terminate()
        process.wait(timeout=30)
    local = Stack(tmp_path, Ports.free()).program_env("collector")
    assert local["OTEL_TRACKING_OTLP_HOST"] == local["OTEL_TRACKING_HOST"] == "127.0.0.1"


def test_agent_config_never_gives_up_and_is_bounded(binaries: dict[str, Path]) -> None:
    """What the outage test cannot reach in seconds: the agent retries without a time limit (the
    queue is the only bound), every pipeline is memory-limited and ends at the gateway, and the
    collector accepts the file."""
    import yaml

    config = AGENT_CONFIG.read_text()
    proc = subprocess.run(
        [str(binaries["collector"]), "validate", "--config", str(AGENT_CONFIG)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(config)
    exporter = cfg["exporters"]["otlp_grpc/gateway"]
    assert exporter["retry_on_failure"]["enabled"] is True
    assert exporter["retry_on_failure"]["max_elapsed_time"] == "0s"
    queue = exporter["sending_queue"]
    assert queue["enabled"] is True and queue["sizer"] == "bytes" and "storage" not in queue
    assert set(cfg["service"]["pipelines"]) == {"traces", "metrics", "logs"}
    for pipeline in cfg["service"]["pipelines"].values():
        assert pipeline["processors"][0] == "memory_limiter"
        assert pipeline["exporters"] == ["otlp_grpc/gateway"]
