"""What a user sees of the demo's run in each viewer, opened in a real browser.

One demo run (``otel-tracking demo`` with TensorBoard, MLflow, Trackio, wandb and the file sink,
its OTLP going to the local stack) is opened the way its printed next steps say: TensorBoard,
MLflow's UI and Trackio's dashboard, each served by its own program, and Prometheus's graph page,
in Debian's ``chromium`` (headless, driven through the DevTools protocol: ``tests/viewers.py``).
The tests assert what a user must find there as text in the page: the run's name, the metric
groups and names, the step axis, the traces under their step names, the generations.  Where a
viewer draws its data on a canvas or as SVG paths, its own data API is read for the numbers.
wandb has no web viewer offline: ``wandb leet inspect --summary`` is its text view.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from otel_tracking_stack.stack import Ports, Stack, ensure_binaries
from tests import viewers
from tests.stack_queries import prom_query
from tests.viewers import Browser, Server

pytestmark = [pytest.mark.backend, pytest.mark.stack]

REPO = Path(__file__).resolve().parents[1]
PROJECT, EXPERIMENT = "otel-tracking-demo", "grpo-simulated"
STEPS, VAL_EVERY, LANES = 12, 5, 4


@dataclass
class DemoRun:
    out: Path
    cwd: Path
    stdout: str
    stderr: str  # the run's summary, with the link to its traces
    lines: list[dict[str, Any]]  # the JSONL file: what was logged, step by step
    stack: Stack
    ended_at: float  # when the demo had exited (Unix time)

    def logged(self, key: str) -> dict[int, float]:
        return {line["step"]: line["data"][key] for line in self.lines if key in line["data"]}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoRun]:
    root = tmp_path_factory.mktemp("viewers")
    stack = Stack(root / "stack", Ports.free(), binaries=ensure_binaries(), spanmetrics_flush="1s")
    stack.start()
    try:
        out, stdout, stderr = viewers.run_demo(
            root, stack.otlp_http_endpoint, STEPS, VAL_EVERY, LANES, traces_url=stack.trace_ui_url
        )
        ended_at = time.time()
        lines = [json.loads(line) for line in (out / f"{EXPERIMENT}.jsonl").read_text().splitlines()]
        yield DemoRun(out, out.parent, stdout, stderr, lines, stack, ended_at)
    finally:
        stack.stop()


@dataclass
class Viewers:
    tensorboard: Server
    mlflow: Server
    trackio: Server
    browser: Browser


@pytest.fixture(scope="module")
def opened(demo: DemoRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Viewers]:
    """Each viewer's server on the demo's run, started at once (MLflow's takes longest), and a browser."""
    logs = tmp_path_factory.mktemp("viewer-logs")
    servers = [
        viewers.tensorboard(_hinted_logdir(demo.stdout), logs),
        viewers.mlflow_ui(f"sqlite:///{demo.out / 'mlflow.db'}", logs),
        viewers.trackio_show(demo.out / "trackio", PROJECT, logs),
    ]
    try:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s, path: s.wait_ready(path, 240), servers, ["/data/runs", "/health", "/"]))
        with viewers.browser() as browser:
            yield Viewers(*servers, browser=browser)
    finally:
        for server in servers:
            server.stop()


def _hinted_logdir(stdout: str) -> Path:
    """The directory the demo's printed next step opens TensorBoard on."""
    match = re.search(r"^\s*tensorboard --logdir (\S+)$", stdout, re.MULTILINE)
    assert match, stdout
    return Path(match.group(1))


def _mlflow_link(stdout: str) -> str:
    link = r"then open http://127\.0\.0\.1:5000/(#/experiments/\d+\?workflowType=machine_learning)$"
    match = re.search(link, stdout, re.M)
    assert match, stdout
    return match.group(1)


# --- where the demo wrote, and what it says to run -------------------------------------------------


def test_the_demo_writes_under_out_in_each_viewers_layout(demo: DemoRun) -> None:
    out = demo.out
    assert (out / f"{EXPERIMENT}.jsonl").is_file()  # not out/otel-tracking-demo/otel-tracking-demo/...
    assert list((out / "tensorboard" / PROJECT / EXPERIMENT).glob("events.out.tfevents.*"))
    assert _hinted_logdir(demo.stdout) == out.resolve() / "tensorboard" / PROJECT
    # MLflow's artifacts (the validation generations) under --out, nothing in the working directory
    artifacts = sorted(p.name for p in (out / "mlflow-artifacts").rglob("val_step*.json"))
    assert artifacts == ["val_step10.json", "val_step5.json"]
    assert sorted(p.name for p in demo.cwd.iterdir()) == ["run"]
    assert f"TRACKIO_DIR={out.resolve() / 'trackio'} trackio show --project {PROJECT}" in demo.stdout


# --- TensorBoard --------------------------------------------------------------------------------


def test_tensorboard_shows_the_run_by_name_its_metric_groups_and_steps(demo: DemoRun, opened: Viewers) -> None:
    base = opened.tensorboard.url
    assert viewers.http_json(base + "/data/runs") == [EXPERIMENT]  # not "."
    page = opened.browser.page(base + "/?forceSVG=true#timeseries")
    text = page.wait_for_text([EXPERIMENT, "/pg_loss", "Horizontal Axis\nStep"])
    groups = dict(re.findall(r"^([\w-]+?)(\d+) cards$", text, re.M))  # each group's header: name, cards
    assert groups == {
        "actor": "6",
        "critic": "8",
        "perf": "5",
        "prompt_length": "3",
        "response_length": "4",
        "anatomy": "7",  # goodput, 3 other shares, the step's wall time, the rollout lanes' straggler and lag
        "timing_s": "10",  # 3 from the demo's own log(), 7 from its spans: one key per phase
        "training": "2",
    }
    tags = viewers.http_json(base + "/data/plugin/scalars/tags")[EXPERIMENT]
    assert {"timing_s/state/generate", "timing_s/state/generate/slowest", "val-core/openai/gsm8k/reward/mean@4"} <= set(
        tags
    )

    # The curve is SVG paths: its points through TensorBoard's data API, one per step.
    def scalars(tag: str) -> dict[int, float]:
        query = urllib.parse.urlencode({"run": EXPERIMENT, "tag": tag})
        return {step: value for _, step, value in viewers.http_json(f"{base}/data/plugin/scalars/scalars?{query}")}

    loss = scalars("actor/pg_loss")
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert loss == pytest.approx(demo.logged("actor/pg_loss"), rel=1e-6)  # float32 in the event file
    for tag in ("timing_s/state/generate", "timing_s/state/generate/slowest"):  # one value per step, all lanes
        assert sorted(scalars(tag)) == list(range(1, STEPS + 1)), tag


def test_tensorboard_text_tab_shows_the_generations(opened: Viewers) -> None:
    page = opened.browser.page(opened.tensorboard.url + "/#text")
    page.wait_for_text(["val/generations/text_summary", "Generation Results - Step 10", "simulated answer 10.0"])


# --- MLflow -------------------------------------------------------------------------------------


def test_mlflows_printed_link_opens_the_training_view_with_the_run(demo: DemoRun, opened: Viewers) -> None:
    page = opened.browser.page(f"{opened.mlflow.url}/{_mlflow_link(demo.stdout)}")
    text = page.wait_for_text(["Model training", "Run Name", EXPERIMENT, "1 matching run"])
    assert "Evaluation runs" not in text  # the GenAI view's navigation is not shown


def test_mlflow_run_page_shows_metric_groups_on_a_step_axis(demo: DemoRun, opened: Viewers) -> None:
    experiment_id = _experiment_id(demo.stdout)
    run_id = re.search(r"mlflow: MLflow run (\w+) ", demo.stdout).group(1)  # type: ignore[union-attr]
    page = opened.browser.page(
        f"{opened.mlflow.url}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?workflowType=machine_learning"
    )
    text = page.wait_for_text(["Model metrics", "pg_loss", "Step", f"{EXPERIMENT} (actor/pg_loss)", "timing_s/state"])
    assert re.search(r"^actor\s*\(6\)$", text, re.M)

    # The charts are canvas: their points through MLflow's REST API, one value per step and key.
    def history(key: str) -> list[tuple[int, float]]:
        query = urllib.parse.urlencode({"run_id": run_id, "metric_key": key})
        found = viewers.http_json(f"{opened.mlflow.url}/ajax-api/2.0/mlflow/metrics/get-history?{query}")
        return sorted((int(m["step"]), m["value"]) for m in found["metrics"])

    assert history("actor/pg_loss") == sorted(demo.logged("actor/pg_loss").items())
    assert [step for step, _ in history("timing_s/state/generate")] == list(range(1, STEPS + 1))  # no sawtooth


def test_mlflow_traces_are_listed_under_their_steps(demo: DemoRun, opened: Viewers) -> None:
    from mlflow import MlflowClient

    experiment_id = _experiment_id(demo.stdout)
    page = opened.browser.page(f"{opened.mlflow.url}/#/experiments/{experiment_id}/traces")
    last = demo.logged("actor/pg_loss")[STEPS]
    text = page.wait_for_text(["Input", "Output", '{"step": 1}', f'{{"step": {STEPS}}}', f'"actor/pg_loss": {last}'])
    assert "\n-\n-\n" not in text  # no trace without input and output
    # Step N's trace, found by its tag through MLflow's own client, is named after its step and
    # opens on its phases.
    client = MlflowClient(f"sqlite:///{demo.out / 'mlflow.db'}")
    (trace,) = client.search_traces(locations=[experiment_id], filter_string=f"tags.`ml.step` = '{STEPS}'")
    assert trace.info.tags["mlflow.traceName"] == f"step {STEPS}"
    page = opened.browser.page(
        f"{opened.mlflow.url}/#/experiments/{experiment_id}/traces?selectedEvaluationId={trace.info.trace_id}"
    )
    page.wait_for_text([f"step {STEPS}", "rollout", "generate", "reward", "update"])


def _experiment_id(stdout: str) -> str:
    return re.search(r"#/experiments/(\d+)", _mlflow_link(stdout)).group(1)  # type: ignore[union-attr]


# --- Trackio ------------------------------------------------------------------------------------


def test_trackio_shows_metric_groups_on_a_step_axis_and_the_generations(demo: DemoRun, opened: Viewers) -> None:
    page = opened.browser.page(opened.trackio.url + "/")
    page.wait_for_text([EXPERIMENT, "actor (6)", "pg_loss", "timing_s", "step"])
    page.click_text("Traces")
    page.wait_for_text(["Step 5 (4)", "Step 10 (4)", "What is 17 * 23?", "simulated answer 10.0", "8 traces"])
    # The score has no column on the Traces page (only in a trace's detail): the same samples as a table
    page.click_text("Media & Tables")
    header = "STEP\tSAMPLE\tINPUT\tOUTPUT\tSCORE"  # (the page's CSS capitalizes them)
    row = "10\t0\tWhat is 17 * 23?\tsimulated answer 10.0\t0."  # step 10, sample 0, its score
    page.wait_for_text(["Tables (2)", "val/generations_table", header, row])


# --- Prometheus (the stack) ----------------------------------------------------------------------


def test_prometheus_graph_page_shows_the_runs_gauges(demo: DemoRun, opened: Viewers) -> None:
    last = demo.logged("actor/pg_loss")[STEPS]

    def arrived() -> bool:
        found = prom_query(demo.stack, f'actor_pg_loss{{ml_experiment="{EXPERIMENT}"}}')
        return bool(found) and float(found[0]["value"][1]) == pytest.approx(last)

    viewers.wait_for(arrived, 120, "the last actor/pg_loss in Prometheus")
    query = urllib.parse.urlencode({"g0.expr": "actor_pg_loss", "g0.tab": "1"})
    page = opened.browser.page(f"{demo.stack.prometheus_url}/graph?{query}")
    page.wait_for_text(["actor_pg_loss{", f'ml_experiment="{EXPERIMENT}"', f'ml_project="{PROJECT}"', str(last)])


def test_every_grafana_panel_answers_for_the_demos_run(demo: DemoRun) -> None:
    """The dashboard queries what the demo logs (``actor/pg_loss`` is ``actor_pg_loss``) and what
    its spans carry (the rollout lanes' ``generate`` spans): every panel has data for this run."""
    import importlib.util

    path = REPO / "otel_tracking_stack" / "deploy" / "grafana" / "panel_queries.py"
    spec = importlib.util.spec_from_file_location("otel_tracking_panel_queries", path)
    assert spec is not None and spec.loader is not None
    panel_queries = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = panel_queries  # its dataclass looks its module up there
    spec.loader.exec_module(panel_queries)
    queries = panel_queries.all_queries(variables={"ml_project": PROJECT, "ml_experiment": EXPERIMENT})

    # The rate panels look back one minute ($__rate_interval): ask as of shortly after the run,
    # once Prometheus has scraped that far (the last step's gauge is there at that time).
    at = demo.ended_at + 20
    step = f'train_step{{ml_experiment="{EXPERIMENT}"}}'

    def scraped_until_then() -> bool:
        found = prom_query(demo.stack, f"timestamp({step})", time_=at)
        return bool(found) and float(found[0]["value"][1]) >= at - 3  # samples 1 s apart reach that time

    viewers.wait_for(scraped_until_then, 180, "Prometheus to have scraped until 20 s after the demo")
    assert [float(r["value"][1]) for r in prom_query(demo.stack, step, time_=at)] == [STEPS]
    unanswered = [f"{q.panel_title}: {q.query}" for q in queries if not prom_query(demo.stack, q.query, time_=at)]
    assert not unanswered
    (lanes,) = [q for q in queries if q.panel_type == "state-timeline"]
    # each of the demo's rollout lanes shows as generating (1), from its generate spans
    found = {r["metric"]["ml_lane"]: float(r["value"][1]) for r in prom_query(demo.stack, lanes.query, time_=at)}
    assert found == {str(lane): 1.0 for lane in range(LANES)}


# --- the stack's trace UI (Zipkin) ---------------------------------------------------------------


def test_the_trace_ui_lists_the_runs_steps_and_shows_a_steps_waterfall(demo: DemoRun, opened: Viewers) -> None:
    """The summary's link opens Zipkin's search with the run's traces listed; a step's trace is a
    waterfall: the step root, its phases as timed children, the rollout lanes under rollout, and the
    selected span's ``ml.*`` tags; the stack's Jaeger still answers its API."""
    match = re.search(r"^otel-tracking: the run's traces: (\S+)$", demo.stderr, re.M)
    assert match, demo.stderr
    page = opened.browser.page(match.group(1))
    text = page.wait_for_text(["Results", "otel-tracking-demo: ml.step"])
    assert text.count("otel-tracking-demo: ml.step") == STEPS  # one trace per step, its root the step

    trace_id = viewers.step_trace_id(demo.stack.ports.zipkin, 3)
    page = opened.browser.page(f"{demo.stack.trace_ui_url}traces/{trace_id}")
    text = page.wait_for_text(["Total Spans", "Tags", "ml.step"])
    header = re.search(r"Total Spans\n(\d+)", text)
    # the step root, the demo's step span, rollout/reward/update, a generate per lane
    assert header and int(header.group(1)) == 2 + 3 + LANES
    rows = re.findall(r"^otel-tracking-demo: ([\w.]+)\n([\d.]+m?s)$", text, re.M)  # each bar: name, duration
    assert [name for name, _ in rows] == ["ml.step", "step", "rollout", *["generate"] * LANES, "reward", "update"]
    # the root is selected: its tags, the run's identity among them
    tags = dict(re.findall(r"^(ml\.[\w.]+)\t(.*)$", text, re.M))
    assert tags["ml.step"] == "3" and tags["ml.experiment"] == EXPERIMENT and tags["ml.project"] == PROJECT
    api = f"http://127.0.0.1:{demo.stack.ports.zipkin}/api/v2/trace/{trace_id}"
    spans = {span["name"]: span for span in viewers.http_json(api)}
    assert spans["step"]["parentId"] == spans["ml.step"]["id"] and spans["rollout"]["parentId"] == spans["step"]["id"]
    assert spans["generate"]["parentId"] == spans["rollout"]["id"]
    assert viewers.http_json(f"{demo.stack.jaeger_url}/api/services")["data"]  # Jaeger, beside it, still answers


# --- wandb's terminal viewer -----------------------------------------------------------------------


def test_wandb_leet_shows_the_runs_summary(demo: DemoRun) -> None:
    (run_dir,) = (demo.out / "wandb").glob("offline-run-*")
    done = subprocess.run(
        [str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--summary", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert re.search(rf"^run\s+{EXPERIMENT} ", text, re.M)
    assert re.search(r"^state\s+finished \(exit code 0\)$", text, re.M)
    assert re.search(rf"^step\s+{STEPS}$", text, re.M)
    last = demo.logged("actor/pg_loss")[STEPS]
    assert re.search(rf"^\s+actor/pg_loss\s+{re.escape(repr(last))}$", text, re.M)
    for key in ("timing_s/state/generate", "timing_s/state/generate/slowest", "val/generations"):
        assert re.search(rf"^\s+{re.escape(key)}\s", text, re.M), key
