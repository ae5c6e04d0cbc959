"""`otel-tracking replay` against damaged and busy spool files: every intact record is delivered,
each damaged one is named (file and byte offset) and skipped, a file still being written is left
alone, and the other files go on."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_tracking.delivery.spool import Damaged, Spool, read_spool
from tests.otlp_receiver import HttpReceiver, wait_for


def _spool(path: Path, run_id: str, n: int) -> Spool:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for i in range(n):
        with provider.get_tracer("t").start_as_current_span(f"{run_id}-{i}"):
            pass
    header = {"sink": "otlp-traces", "project": "proj", "experiment": "exp", "run_id": run_id, "pid": os.getpid()}
    spool = Spool(path, header)
    for span in memory.get_finished_spans():
        spool.write("spans", [span])
    return spool


def _replay(receiver: HttpReceiver, *paths: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    return subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", *map(str, paths)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_damaged_records_are_skipped_and_named_and_everything_else_arrives(isolated: Path) -> None:
    damaged_path = isolated / "a" / "otlp-traces.jsonl"
    intact_path = isolated / "b" / "otlp-traces.jsonl"
    _spool(damaged_path, "damaged", 40).close()
    _spool(intact_path, "intact", 40).close()
    data = bytearray(damaged_path.read_bytes())
    lines = data.splitlines(keepends=True)
    middle = sum(len(line) for line in lines[:11])  # byte offset of record 10 (after the header)
    data[middle + 40] ^= 0x01  # one flipped bit inside record 10
    cut = len(data) - len(lines[-1]) // 2  # the last record cut short, as a kill or a full disk leaves it
    damaged_path.write_bytes(bytes(data[:cut]))

    _, records = read_spool(damaged_path)
    bad = [r for r in records if isinstance(r, Damaged)]
    assert [(b.offset, b.reason) for b in bad] == [
        (middle, "checksum mismatch"),
        (len(data) - len(lines[-1]), "cut short (no end of line)"),
    ]

    with HttpReceiver() as receiver:
        done = _replay(receiver, damaged_path.parent, intact_path.parent)
        names = wait_for(
            lambda: (found := {s["name"] for s in receiver.received.spans()}) and len(found) >= 78 and found,
            what="78 spans",
        )
    assert names == {f"damaged-{i}" for i in range(39) if i != 10} | {f"intact-{i}" for i in range(40)}
    assert done.returncode == 1, "damaged records make the replay report trouble"
    assert f"{damaged_path}: damaged record at byte {middle} skipped (checksum mismatch)" in done.stderr
    assert f"{damaged_path}: 38/40 records delivered (38/38 items), 2 damaged record(s) skipped" in done.stderr
    assert f"{intact_path}: 40/40 records delivered (40/40 items)" in done.stderr
    assert list(intact_path.parent.iterdir()) == [], "a log delivered in full is removed, its position with it"


def test_an_empty_spool_file_is_nothing_to_replay_not_an_error(isolated: Path) -> None:
    """A process killed between creating its spool file and writing the header leaves it empty:
    nothing was spooled, so nothing is lost and replay succeeds (test_link_invariant met it)."""
    empty = isolated / "killed" / "tensorboard.jsonl"
    empty.parent.mkdir(parents=True)
    empty.touch()
    _spool(isolated / "killed" / "otlp-traces.jsonl", "beside", 2).close()
    with HttpReceiver() as receiver:
        done = _replay(receiver, isolated / "killed")
        wait_for(lambda: len(receiver.received.spans()) == 2, what="the other file's 2 spans")
    assert done.returncode == 0, done.stderr
    assert f"{empty}: empty (its process stopped before writing to it); nothing to replay" in done.stderr
    assert empty.exists(), "not renamed: a writer that just created it would go on writing to the renamed file"


def test_a_file_still_being_written_is_delivered_to_its_end_and_left_for_the_next_replay(isolated: Path) -> None:
    """A running run's spool log (its writer holds it open): what it holds so far is delivered,
    the log stays with its position, and the exit code says something is left (it was 0, and
    ``replay && rm -rf spool`` deleted what the run appended later).  Once the writer is gone,
    the next replay delivers only what came since and removes the log."""
    busy = _spool(isolated / "busy" / "otlp-traces.jsonl", "busy", 3)  # open: a running run's spool
    with HttpReceiver() as receiver:
        done = _replay(receiver, isolated / "busy")
        assert done.returncode == 75, done.stderr
        assert f"{busy.path}: 3/3 records delivered (3/3 items); a running process still writes it" in done.stderr
        assert "1 file(s) still being written by a running process, left for the next replay" in done.stderr
        wait_for(lambda: len(receiver.received.spans()) == 3, what="the 3 spans written so far")
        assert busy.path.exists() and busy.path.with_name("otlp-traces.jsonl.pos").exists()
        again = _replay(receiver, isolated / "busy")
        assert again.returncode == 75, again.stderr
        assert "nothing new; a running process still writes it" in again.stderr
        _spool(busy.path, "later", 2).close()  # the run goes on appending (another writer of it)
        busy.close()
        final = _replay(receiver, isolated / "busy")
        assert final.returncode == 0, final.stderr
        names = wait_for(lambda: len(receiver.received.spans()) == 5 and receiver.received.spans(), what="5 spans")
    assert sorted(span["name"] for span in names) == ["busy-0", "busy-1", "busy-2", "later-0", "later-1"]
    assert list(busy.path.parent.iterdir()) == []


def test_a_path_that_does_not_exist_is_an_error(isolated: Path) -> None:
    """An expected error, exit code 1 as the docs say of them all (argparse's usage errors are 2)."""
    with HttpReceiver() as receiver:
        done = _replay(receiver, isolated / "nope")
    assert done.returncode == 1
    assert done.stderr == f"otel-tracking replay: no such file or directory: {isolated / 'nope'}\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _bar_frames(text: str) -> list[str]:
    return [frame.split("\n")[0] for frame in text.split("\r") if " <- " in frame]


def test_the_progress_bar_fills_with_what_was_delivered(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal the bar is as full as what the endpoint took: empty when it is down (it
    filled to 100% while saying "0/1 delivered"), and its last frame agrees with the file's line
    (an end record is not data: it counted as one more delivered record)."""
    from otel_tracking.delivery import replay
    from tests.conftest import free_port

    path = isolated / "run" / "otlp-traces.jsonl"
    _spool(path, "r", 2).end(0)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("OTEL_TRACKING_MAX_ATTEMPTS", "1")
    down = _Terminal()
    assert replay.main([str(path)], out=down) == 75, "something is left for the next replay"
    empty = "." * 30
    assert _bar_frames(down.getvalue()) == [
        f"otlp-traces <- otlp-traces.jsonl [{empty}] 0/2 delivered, 1 not",
        f"otlp-traces <- otlp-traces.jsonl [{empty}] 0/2 delivered, 2 not",
    ]
    assert f"{path}: 0/2 records delivered (0/2 items), 2 not delivered: kept for the next replay\n" in down.getvalue()

    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        up = _Terminal()
        assert replay.main([str(path)], out=up) == 0
    half, full = "#" * 15 + "." * 15, "#" * 30
    assert _bar_frames(up.getvalue()) == [
        f"otlp-traces <- otlp-traces.jsonl [{half}] 1/2 delivered",
        f"otlp-traces <- otlp-traces.jsonl [{full}] 2/2 delivered",
    ]
    assert f"{path}: 2/2 records delivered (2/2 items)\n" in up.getvalue()


def test_replay_with_the_endpoint_down_prints_lines_and_a_summary_when_not_a_terminal(isolated: Path) -> None:
    """Piped or logged, no bar (its frames ran together on one line): one line per file, then the
    summary the sink's first-failure warning promised; the files are kept, exit code 1."""
    from tests.conftest import free_port

    first, second = isolated / "a" / "otlp-traces.jsonl", isolated / "b" / "otlp-traces.jsonl"
    _spool(first, "a", 3).close()
    _spool(second, "b", 2).close()
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACKING_MAX_ATTEMPTS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", str(isolated / "a"), str(isolated / "b")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 75
    assert "\r" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "is not reachable now" not in line]
    where = f"OTLP http/protobuf -> {endpoint} (traces, metrics, logs)"
    assert lines == [
        f"otlp-traces: {first} -> {where}",
        "otel-tracking: sink 'otlp-traces' failed to export spans: OTLPExportError: cannot connect to "
        f"{endpoint}/v1/traces (Connection refused) (further failures are counted in the summary at the end)",
        f"{first}: 0/3 records delivered (0/3 items), 3 not delivered: kept for the next replay",
        f"otlp-traces: {second} -> {where}",
        "otel-tracking: sink 'otlp-traces' failed to export spans: OTLPExportError: cannot connect to "
        f"{endpoint}/v1/traces (Connection refused) (further failures are counted in the summary at the end)",
        f"{second}: 0/2 records delivered (0/2 items), 2 not delivered: kept for the next replay",
        "otel-tracking replay: 2 file(s), 0/5 records delivered (0/5 items), 5 not delivered: kept for the next replay",
    ]
    assert first.exists() and second.exists()


def test_a_file_replayed_already_is_refused(isolated: Path) -> None:
    """``replay x.jsonl.replayed`` (an older release renamed a log it delivered in full so) sent
    everything again and exited 0: now one line says why not and how to do it on purpose, exit
    code 1, and nothing is sent."""
    path = isolated / "run" / "otlp-traces.jsonl"
    _spool(path, "r", 2).close()
    with HttpReceiver() as receiver:
        assert _replay(receiver, path).returncode == 0
        wait_for(lambda: len(receiver.received.spans()) == 2, what="2 spans")
        replayed = path.with_name("otlp-traces.jsonl.replayed")
        _spool(replayed, "r", 2).close()
        again = _replay(receiver, replayed)
        assert again.returncode == 1
        assert again.stderr == (
            f"otel-tracking replay: {replayed}: replayed already (everything in it was delivered); "
            "to deliver it again, rename it without .replayed\n"
        )
        assert _replay(receiver, isolated / "run").stderr == "nothing to replay\n"  # a directory skips it
        assert len(receiver.received.spans()) == 2


def test_ranks_sharing_a_run_id_spool_to_files_of_their_own(isolated: Path, monkeypatch: object) -> None:
    """Two ranks of one job (one run id, each with its own tracker runs) never share a spool file,
    so each file's header names the right run to replay into."""
    from otel_tracking.config.settings import build_settings
    from otel_tracking.delivery.pipeline import Sink
    from otel_tracking.delivery.spool import sink_spool
    from otel_tracking.exporters._base import SinkParts

    paths = []
    for rank in ("0", "1"):
        env = {"OTEL_TRACKING_RUN_ID": "job-7", "RANK": rank, "OTEL_TRACKING_SPOOL_DIR": str(isolated)}
        settings = build_settings("proj", "exp", (), env=env)
        sink = Sink("mlflow", SinkParts(resume={"run_id": f"mlflow-run-of-rank-{rank}"}))
        spool = sink_spool(sink, settings, pid=1)
        assert spool is not None
        paths.append(spool.path)
        assert spool.header["resume"] == {"run_id": f"mlflow-run-of-rank-{rank}"}
    assert paths[0] != paths[1] and paths[0].parent == paths[1].parent


def test_replay_goes_where_the_run_went_and_says_so(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's endpoint is down; replay with no OTLP variable set sends to that endpoint (kept
    in the spool header), not to the SDK's localhost default, and prints where it sends."""
    from otel_tracking import Tracking, trace_state
    from tests.conftest import free_port

    port = free_port()  # nothing listens there during the run
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_TRACKING_MAX_ATTEMPTS", "1")
    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("rollout"):
        pass
    tracking.log({"loss": 0.5}, step=1)
    stats = tracking.finish()
    assert stats["otlp-traces"]["spooled"] == 2  # the phase and its step's root span

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    with HttpReceiver(port) as receiver:
        done = subprocess.run(
            [sys.executable, "-m", "otel_tracking", "replay"], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        names = wait_for(lambda: sorted(s["name"] for s in receiver.received.spans()) or None, what="spans")
    assert names == ["ml.step", "rollout"]
    assert f"-> OTLP http/protobuf -> {receiver.endpoint}/v1/traces (the run's endpoint, kept in its spool)" in (
        done.stderr
    )


def test_replay_delivers_the_attempts_of_a_run_in_the_order_they_were_logged(isolated: Path) -> None:
    """Files were replayed sorted by name: ``*.attempt2.jsonl`` before ``*.jsonl``, and a reopened
    wandb run drops steps below its current one, so attempt 1's spooled steps were lost (issue 19,
    item 6).  Attempt 10 comes after attempt 2, and each rank's files keep their own order."""
    from otel_tracking.delivery.replay import spool_files

    run = isolated / "spool" / "proj" / "exp-r1"
    names = [
        "otlp-traces.attempt10.jsonl",
        "otlp-traces.attempt2.jsonl",
        "otlp-traces.jsonl",
        "otlp-traces.link.jsonl",
        "otlp-traces.attempt2.link.jsonl",
        "otlp-traces.rank1.attempt2.jsonl",
        "otlp-traces.rank1.jsonl",
    ]
    for name in names:
        _spool(run / name, name.removesuffix(".jsonl"), 2).close()
    assert [p.name for p in spool_files([isolated / "spool"])] == [
        "otlp-traces.jsonl",
        "otlp-traces.link.jsonl",
        "otlp-traces.attempt2.jsonl",
        "otlp-traces.attempt2.link.jsonl",
        "otlp-traces.attempt10.jsonl",
        "otlp-traces.rank1.jsonl",
        "otlp-traces.rank1.attempt2.jsonl",
    ]
    with HttpReceiver() as receiver:
        done = _replay(receiver, run / "otlp-traces.attempt2.jsonl", run / "otlp-traces.jsonl")
        assert done.returncode == 0, done.stderr
        spans = wait_for(
            lambda: [s["name"] for s in receiver.received.spans()] if len(receiver.received.spans()) == 4 else None,
            what="spans",
        )
    assert spans == ["otlp-traces-0", "otlp-traces-1", "otlp-traces.attempt2-0", "otlp-traces.attempt2-1"]


@pytest.mark.backend  # a real mlflow server: not in the floor venv, which has no tracker extras
def test_replay_of_a_tracker_that_never_opened_goes_to_the_store_the_run_named(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow unreachable during the run, so it never opened and its spool header named no store:
    replay without MLFLOW_TRACKING_URI made a new experiment in the default sqlite store and
    exited 0 (issue 19, item 5).  The header now names the store the run was configured with."""
    from otel_tracking import Tracking
    from tests import readers_mlflow
    from tests.conftest import free_port
    from tests.servers import MlflowServer

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(isolated / "logs"))
    tracking = Tracking("proj", "exp", default_backend=["file", "mlflow"])
    for step in range(1, 6):
        tracking.log({"loss": 1.0 / step}, step)
    stats = tracking.finish()
    assert stats["mlflow"]["spooled"] == 5 and stats["mlflow"]["delivered"] == 0
    (spool,) = (isolated / "spool").rglob("mlflow*.jsonl")
    header, _ = read_spool(spool)
    assert header["destination"] == {"MLFLOW_TRACKING_URI": uri}

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    server = MlflowServer(isolated / "server", port=port).start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "otel_tracking", "replay", str(isolated / "spool")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        client = readers_mlflow.client(server.uri)
        run = readers_mlflow.only_run(client, client.get_experiment_by_name("proj").experiment_id)
        assert readers_mlflow.metric_triples(client, run.info.run_id) == [("loss", s, 1.0 / s) for s in range(1, 6)]
    finally:
        server.stop()


def test_a_destination_with_credentials_is_not_kept_and_replay_asks_for_it(isolated: Path) -> None:
    from otel_tracking.config.destinations import destination, with_destination
    from otel_tracking.config.settings import build_settings

    settings = build_settings("p", "e", (), env={"MLFLOW_TRACKING_URI": "https://user:secret@mlflow.example"})
    kept = destination("mlflow", settings)
    assert kept == {"MLFLOW_TRACKING_URI": None} and "secret" not in repr(kept)
    from otel_tracking.config.settings import ConfigError

    with pytest.raises(ConfigError, match="set MLFLOW_TRACKING_URI to replay it"):
        with_destination({}, kept)
    assert with_destination({"MLFLOW_TRACKING_URI": "sqlite:///x.db"}, kept)["MLFLOW_TRACKING_URI"] == "sqlite:///x.db"
    tb = destination("tensorboard", build_settings("p", "e", (), env={}))
    assert tb == {"TENSORBOARD_DIR": str(isolated / "tensorboard_log" / "p" / "e")}, (
        "absolute: replay may run elsewhere"
    )


@pytest.mark.backend  # MLflow: not in the floor venv, which has no tracker extras
def test_replay_goes_through_the_sinks_queue_in_bulk_and_retries_there(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replay hands the records to the sink's queue, the engine every sink has (issue 36): MLflow's
    bulk path packs many spooled steps into one ``log_batch`` (it took one call per step), and a
    request the backend refuses once is retried there instead of kept for the next replay.  Every
    (key, step, value) arrives once."""
    from mlflow.tracking import MlflowClient
    from opentelemetry.sdk.resources import Resource

    from otel_tracking.delivery import replay
    from otel_tracking.signals.steps import StepBatch
    from tests import readers_mlflow

    uri = f"sqlite:///{isolated / 'mlflow.db'}"
    path = isolated / "spool" / "p" / "e-r1" / "mlflow.jsonl"
    header = {"sink": "mlflow", "project": "p", "experiment": "e", "run_id": "r1", "pid": 1}
    spool = Spool(path, {**header, "destination": {"MLFLOW_TRACKING_URI": uri}})
    steps = 300
    for step in range(steps):
        spool.write("metrics", StepBatch(Resource.create({}), step, {"loss": step / 10, "lr": 1e-3}, {}, 1 + step))
    spool.close()
    calls: list[int] = []
    real = MlflowClient.log_batch

    def refuse_the_second(self: MlflowClient, run_id: str, metrics: Any = (), **kwargs: Any) -> Any:
        calls.append(len(metrics))
        if len(calls) == 2:
            raise ConnectionError("refused once")
        return real(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", refuse_the_second)
    out = io.StringIO()
    assert replay.main([str(path)], out=out) == 0, out.getvalue()
    assert f"{path}: {steps}/{steps} records delivered ({steps}/{steps} items)" in out.getvalue()
    metric_calls = [n for n in calls if n]
    assert len(metric_calls) < steps / 10, metric_calls  # many steps a request
    client = readers_mlflow.client(uri)
    run = readers_mlflow.only_run(client, client.get_experiment_by_name("p").experiment_id)
    expected = sorted([("loss", s, s / 10) for s in range(steps)] + [("lr", s, 1e-3) for s in range(steps)])
    assert sorted(readers_mlflow.metric_triples(client, run.info.run_id)) == expected


def test_the_exit_code_of_something_left_is_in_replays_help() -> None:
    """``--help`` (and the CLI reference, generated from the same parser) says what 75 means."""
    shown = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert "Exit code 0 only when everything was delivered and nothing is left to deliver" in shown.stdout
    assert "75 when something is left for a later replay: a file a running process still writes" in shown.stdout


@pytest.mark.backend  # MLflow: not in the floor venv, which has no tracker extras
def test_a_replay_mlflow_refuses_midway_leaves_only_what_did_not_land_and_the_next_sends_each_point_once(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow goes away midway through a group of steps: its first request landed (some keys of
    each step), the next did not, and the steps behind were never tried.  Nothing goes to a second
    file: the position stays before the first step not delivered in full and notes what of each
    step is left.  The next replay sends only that, into the same run (the spool named none: the
    first replay made it): each (key, step) reaches MLflow once."""
    from mlflow.tracking import MlflowClient
    from opentelemetry.sdk.resources import Resource

    from otel_tracking.delivery import replay
    from otel_tracking.signals.steps import StepBatch
    from tests import readers_mlflow

    uri = f"sqlite:///{isolated / 'mlflow.db'}"
    path = isolated / "spool" / "p" / "e-r1" / "mlflow.jsonl"
    header = {"sink": "mlflow", "project": "p", "experiment": "e", "run_id": "r1", "pid": 1}
    spool = Spool(path, {**header, "destination": {"MLFLOW_TRACKING_URI": uri}})
    steps, keys = 300, [f"k{k:02d}" for k in range(60)]  # 16 steps fill a request of 1,000 metrics
    for step in range(steps):
        values = {key: step + k / 10 for k, key in enumerate(keys)}
        spool.write("metrics", StepBatch(Resource.create({}), step, values, {}, 1 + step))
    spool.close()
    landed: list[tuple[str, int]] = []
    big: list[int] = []
    real = MlflowClient.log_batch
    down = True

    def gone_midway(self: MlflowClient, run_id: str, metrics: Any = (), **kwargs: Any) -> Any:
        if down and big:  # gone after the first full request: the rest of its group does not land
            raise ConnectionError("gone")
        answer = real(self, run_id, metrics=metrics, **kwargs)
        if len(metrics) >= 1000:
            big.append(len(metrics))
        landed.extend((m.key, m.step) for m in metrics)
        return answer

    monkeypatch.setattr(MlflowClient, "log_batch", gone_midway)
    monkeypatch.setenv("OTEL_TRACKING_MAX_ATTEMPTS", "1")
    first = io.StringIO()
    assert replay.main([str(path)], out=first) == 75, first.getvalue()
    assert "not delivered: kept for the next replay" in first.getvalue()
    assert sorted(path.parent.iterdir()) == [path, path.with_name("mlflow.jsonl.pos")], "no second file"
    position = json.loads(path.with_name("mlflow.jsonl.pos").read_text())
    assert any(state == "rest" for _, _, state, _ in position["after"]), "steps that landed in part"
    partly = {step for _, step in landed} - {step for step in range(steps) if all((k, step) in landed for k in keys)}
    assert partly, "the first replay left steps of which some keys landed"

    down = False
    second = io.StringIO()
    assert replay.main([str(path)], out=second) == 0, second.getvalue()
    assert list(path.parent.iterdir()) == []
    twice = [point for point in set(landed) if landed.count(point) > 1]
    assert not twice, f"sent twice: {sorted(twice)[:5]}"
    client = readers_mlflow.client(uri)
    run = readers_mlflow.only_run(client, client.get_experiment_by_name("p").experiment_id)
    expected = sorted((key, s, s + k / 10) for s in range(steps) for k, key in enumerate(keys))
    assert sorted(readers_mlflow.metric_triples(client, run.info.run_id)) == expected


def test_an_older_releases_interrupted_replay_is_carried_over(isolated: Path) -> None:
    """An older release's replay, stopped, left ``<file>.position`` (inode, offset of the first
    record not settled, length of its ``.retry`` file, in flight, where the flight ended) and
    ``<file>.retry`` (what the backend refused, then a record it had begun to write again).  This
    release delivers what the retry file held up to that length, then the log from that offset:
    nothing twice, nothing lost, and no file of either left."""
    run = isolated / "run"
    path = run / "otlp-traces.jsonl"
    _spool(path, "log", 5).close()
    lines = path.read_bytes().splitlines(keepends=True)
    offset = sum(len(line) for line in lines[:4])  # the header and records 0-2 were settled
    retry = _spool(run / "otlp-traces.jsonl.retry", "refused", 1)  # record 1 was refused
    retry.close()
    length = retry.path.stat().st_size
    _spool(retry.path, "written-again", 1).close()  # past the length the position names: not to send
    position = run / "otlp-traces.jsonl.position"
    position.write_text(f"{path.stat().st_ino:020d} {offset:020d} {length:020d} 0 {0:020d}\n")
    with HttpReceiver() as receiver:
        done = _replay(receiver, run)
        assert done.returncode == 0, done.stderr
        names = wait_for(lambda: len(receiver.received.spans()) >= 3 and receiver.received.spans(), what="3 spans")
    assert sorted(span["name"] for span in names) == ["log-3", "log-4", "refused-0"]
    assert list(run.iterdir()) == []


def test_records_a_killed_replay_had_on_their_way_are_set_aside_and_can_be_replayed_by_name(isolated: Path) -> None:
    """The position says two records were on their way when replay was killed: the next replay
    does not send them (they may have arrived), copies them to ``<file>.in-doubt``, a spool file
    of its own, delivers the rest and exits 75; replaying that file by name delivers them."""
    from otel_tracking.delivery.position import LogPosition, log_id
    from otel_tracking.delivery.spool import read_header

    run = isolated / "run"
    path = run / "otlp-traces.jsonl"
    _spool(path, "r", 5).close()
    _, header_line = read_header(path)
    lines = path.read_bytes().splitlines(keepends=True)
    first, third = len(lines[0]), sum(len(line) for line in lines[:3])
    LogPosition(run / "otlp-traces.jsonl.pos", log_id(path, header_line), first, third).save()
    doubt = run / "otlp-traces.jsonl.in-doubt"
    with HttpReceiver() as receiver:
        done = _replay(receiver, run)
        assert done.returncode == 75, done.stderr
        assert "a replay was killed while 2 record(s) were on their way" in done.stderr
        assert f"{path}: 3/3 records delivered (3/3 items), 2 set aside in doubt (*.in-doubt)" in done.stderr
        assert sorted(p.name for p in run.iterdir()) == [doubt.name]
        wait_for(lambda: len(receiver.received.spans()) == 3, what="3 spans")
        by_name = _replay(receiver, doubt)
        assert by_name.returncode == 0, by_name.stderr
        names = wait_for(lambda: len(receiver.received.spans()) == 5 and receiver.received.spans(), what="5 spans")
    assert sorted(span["name"] for span in names) == [f"r-{i}" for i in range(5)]
    assert list(run.iterdir()) == []


def test_two_replays_of_one_run_take_turns(isolated: Path) -> None:
    """A replay while another holds the run's directory leaves its files to that one (exit 75)."""
    import fcntl

    run = isolated / "run"
    _spool(run / "otlp-traces.jsonl", "r", 2).close()
    other = os.open(run, os.O_RDONLY)  # another replay's turn
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        with HttpReceiver() as receiver:
            done = _replay(receiver, run)
            assert done.returncode == 75, done.stderr
            assert "a running job or another replay is delivering this run's logs right now; left to it" in done.stderr
            assert receiver.received.spans() == []
    finally:
        os.close(other)
    assert (run / "otlp-traces.jsonl").exists()
