"""TensorBoard bridge: event files written through the facade and through a plain OTel SDK setup,
read back with TensorBoard's own ``EventAccumulator``, and compared with what the reference
(verl's tracking.py) would have written.

The reference writes through ``torch.utils.tensorboard.SummaryWriter`` and torch is not installed
here, so its TensorBoard path cannot run as is.  The differential test runs the reference's own
code with a recording stand-in for ``SummaryWriter`` and turns the recorded calls into what torch
stores (``add_scalar``: tag, step, float32 ``simple_value``; ``add_text``: tag + ``/text_summary``,
a one-string ``DT_STRING`` tensor); that mapping is the part this file assumes rather than runs.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import PlainSdk

pytestmark = pytest.mark.backend

CONFIG = {"trainer": {"total_epochs": 2, "lr": 0.1}, "api_key": "sk-tb-secret-123456"}
SAMPLES = [["what is 2+2?", "4", 1.0], ["capital of France?", "Lyon", 0], ["only one part"]]
TEXT_TAG = "val/generations/text_summary"
# The reference's markdown for SAMPLES at step 10, written out by hand.
EXPECTED_TEXT = (
    "**Generation Results - Step 10**\n\n"
    "### Sample 1\n**Input:** what is 2+2?\n\n**Output:** 4\n\n**Score:** 1.0\n\n---\n\n"
    "### Sample 2\n**Input:** capital of France?\n\n**Output:** Lyon\n\n**Score:** 0\n\n---\n\n"
    "### Sample 3\n**Data:** ['only one part']\n\n---\n\n"
)


def f32(value: float) -> float:
    """A value as TensorBoard's float32 ``simple_value`` holds it."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def steps_payloads() -> list[tuple[dict[str, Any], int]]:
    return [
        ({"train/loss": 0.1, "train/acc": 0, "lr": 1e-3, "flag": True}, 0),
        ({"train/loss": float("nan"), "grad/norm": float("inf"), "neg": float("-inf")}, 1),
        ({"train/loss": 0.25, "val-core/gsm8k/reward/mean@4": 0.75, "ünï/cødé": 3, "a key": 2.5}, 2),
        ({"big": 2**40, "train/loss": 0.0625}, 10),
        ({"train/loss": 0.5}, 5),  # a step going backwards is kept
    ]


NOT_NUMBERS = {"note": "a string is not a number", "nothing": None, "items": [1, 2]}

EXPECTED_SCALARS = {
    "train/loss": [(0, f32(0.1)), (1, math.nan), (2, 0.25), (10, 0.0625), (5, 0.5)],
    "train/acc": [(0, 0.0)],
    "lr": [(0, f32(1e-3))],
    "flag": [(0, 1.0)],
    "grad/norm": [(1, math.inf)],
    "neg": [(1, -math.inf)],
    "val-core/gsm8k/reward/mean@4": [(2, 0.75)],
    "ünï/cødé": [(2, 3.0)],
    "a key": [(2, 2.5)],
    "big": [(10, float(2**40))],
}


# --- reading back ------------------------------------------------------------------------------


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def read_events(directory: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[tuple[int, str]]], Any]:
    """(scalars by tag, texts by tag, accumulator) through TensorBoard's own reader, nothing sampled."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    scalars = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in tags["scalars"]}
    texts = {
        tag: [(e.step, b"".join(e.tensor_proto.string_val).decode("utf-8")) for e in accumulator.Tensors(tag)]
        for tag in tags["tensors"]
    }
    return scalars, texts, accumulator


def assert_scalars(actual: dict[str, list[tuple[int, float]]], expected: dict[str, list[tuple[int, float]]]) -> None:
    assert sorted(actual) == sorted(expected)
    for tag, points in expected.items():
        got = actual[tag]
        assert len(got) == len(points), (tag, got, points)
        for (step, value), (want_step, want) in zip(got, points, strict=True):
            assert step == want_step and _same(value, want), (tag, got, points)


def without_timings(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    return {tag: points for tag, points in scalars.items() if not tag.startswith("timing_s/")}


@pytest.fixture
def no_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``import torch`` and ``import tensorflow`` fail while the test runs, even where installed."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    yield


# --- through the facade ------------------------------------------------------------------------


def test_facade_writes_scalars_timings_and_generations_text(
    isolated: Path, no_torch: None, capfd: pytest.CaptureFixture[str]
) -> None:
    from otel_tracking import DapoFilteredRewardTableLogger, Tracking, ValidationGenerationsLogger, trace_state

    tracking = Tracking("proj", "exp", default_backend=["tensorboard"], config=CONFIG)
    # printed by the bridge process, on the same stdout (file descriptor 1)
    assert "Saving tensorboard log to tensorboard_log/proj/exp." in capfd.readouterr().out
    for data, step in steps_payloads():
        with trace_state("gen", step=step):
            pass
        payload = {**data, **NOT_NUMBERS} if step == 2 else data
        tracking.log(payload, step)
    with trace_state("update_actor"):  # no step label: the step in progress (last logged + 1)
        pass
    ValidationGenerationsLogger().log(["tensorboard"], SAMPLES, 10)
    ValidationGenerationsLogger().log(["wandb"], [["not", "for", 0.0]], 11)  # not named: not written
    DapoFilteredRewardTableLogger().log(["tensorboard"], {0.0: 3, 1.0: 5}, 10)  # wandb-only in the reference
    stats = tracking.finish()
    assert stats["tensorboard"]["failed"] == 0

    directory = isolated / "tensorboard_log" / "proj" / "exp"
    assert len(list(directory.glob("events.out.tfevents.*"))) == 1
    scalars, texts, accumulator = read_events(directory)
    assert_scalars(without_timings(scalars), EXPECTED_SCALARS)  # the non-numbers of step 2 are skipped

    gen = scalars["timing_s/state/gen"]
    assert [step for step, _ in gen] == [0, 1, 2, 10, 5]
    assert all(0.0 <= seconds < 5.0 for _, seconds in gen)
    assert [step for step, _ in scalars["timing_s/state/update_actor"]] == [6]

    assert texts == {TEXT_TAG: [(10, EXPECTED_TEXT)]}
    assert accumulator.SummaryMetadata(TEXT_TAG).plugin_data.plugin_name == "text"
    # TensorBoard has no params view in the reference's adapter: the config is nowhere in the files.
    assert b"sk-tb-secret" not in b"".join(p.read_bytes() for p in directory.iterdir())
    assert "torch" not in {name.split(".")[0] for name, module in sys.modules.items() if module is not None}


def test_tensorboard_needs_neither_torch_nor_tensorflow(tmp_path: Path) -> None:
    """The fix: the reference's adapter imports torch; the bridge uses only the tensorboard package.
    In a training process (and so its bridge process, which gets the same path) where importing
    torch or tensorflow fails, whether or not they are installed, every value still arrives."""
    import os
    import subprocess

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("torch", "tensorflow"):
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} is blocked by the test')\n")
    code = (
        "from otel_tracking import Tracking\n"
        "t = Tracking('p', 'e', default_backend='tensorboard')\n"
        "t.log({'x': 1.0}, 0)\n"
        "print(t.finish()['tensorboard'])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "'delivered': 1" in done.stdout and "blocked by the test" not in done.stderr
    scalars, _, _ = read_events(tmp_path / "tensorboard_log" / "p" / "e")
    assert scalars == {"x": [(0, 1.0)]}


def test_tensorboard_dir_from_environment(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_tracking import Tracking

    target = isolated / "elsewhere" / "tb"
    monkeypatch.setenv("TENSORBOARD_DIR", str(target))
    tracking = Tracking("proj", "exp", default_backend="tensorboard")
    tracking.log({"loss": 2.0}, 3)
    tracking.log({"loss": 1.0}, 4)
    where = tracking.where()["tensorboard"]
    tracking.finish()
    assert str(target) in where
    assert not (isolated / "tensorboard_log").exists()
    scalars, _, _ = read_events(target)
    assert scalars == {"loss": [(3, 2.0), (4, 1.0)]}


def test_every_log_call_is_on_disk_before_finish(isolated: Path) -> None:
    from otel_tracking import Tracking

    tracking = Tracking("proj", "exp", default_backend="tensorboard")
    tracking.log({"loss": 0.5}, 1)
    assert tracking.flush()  # log() returns before the worker writes; flush() waits for it
    scalars, _, _ = read_events(isolated / "tensorboard_log" / "proj" / "exp")  # the run is still open
    assert scalars == {"loss": [(1, 0.5)]}
    tracking.finish()


def test_a_dict_reused_and_changed_after_each_log_arrives_as_it_was_at_each_call(isolated: Path) -> None:
    """The usual loop fills one dict and logs it step after step: each step's values are those of
    its call, though the tracker's record is written (and encoded) after log() returned."""
    from otel_tracking import Tracking

    tracking = Tracking("proj", "exp", default_backend="tensorboard")
    metrics: dict[str, float] = {}
    for step in range(5):
        metrics["loss"] = step * 0.5
        metrics["acc"] = step * 0.25
        tracking.log(metrics, step)
    metrics["loss"] = metrics["acc"] = -1.0
    metrics["late"] = 1.0
    assert tracking.flush()
    scalars, _, _ = read_events(isolated / "tensorboard_log" / "proj" / "exp")
    assert scalars == {"loss": [(s, s * 0.5) for s in range(5)], "acc": [(s, s * 0.25) for s in range(5)]}
    tracking.finish()


def test_exporters_return_failure_after_the_session_closed(isolated: Path) -> None:
    from opentelemetry.sdk._logs.export import LogRecordExportResult
    from opentelemetry.sdk.metrics.export import MetricExportResult
    from opentelemetry.sdk.resources import Resource

    from otel_tracking.exporters._base import TrackerContext
    from otel_tracking.exporters.tensorboard import open_tracker
    from otel_tracking.signals.steps import step_batch

    parts = open_tracker(TrackerContext(project="p", experiment="e", env={}))
    batch = step_batch(Resource.create({}), 1, {"x": 1.0}, {}, 1)
    assert parts.metrics.export(batch) is MetricExportResult.SUCCESS
    parts.finish(0)
    assert parts.metrics.export(batch) is MetricExportResult.FAILURE
    assert parts.logs.export([]) is LogRecordExportResult.SUCCESS


def test_event_file_writer_is_looked_up_at_open_time(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb's sync_tensorboard (the vemlp_wandb backend uses it, as the reference did) learns the
    log directory by replacing ``event_file_writer.EventFileWriter``; the bridge must go through it."""
    from tensorboard.summary.writer import event_file_writer

    from otel_tracking import Tracking

    seen: list[str] = []

    class Hooked(event_file_writer.EventFileWriter):  # type: ignore[misc]
        def __init__(self, logdir: str, *args: Any, **kwargs: Any) -> None:
            seen.append(logdir)
            super().__init__(logdir, *args, **kwargs)

    monkeypatch.setattr(event_file_writer, "EventFileWriter", Hooked)
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", "false")  # the hook is in this process
    tracking = Tracking("proj", "exp", default_backend="tensorboard")
    tracking.log({"x": 1.0}, 0)
    tracking.finish()
    assert seen == ["tensorboard_log/proj/exp"]


# --- through a plain OpenTelemetry SDK setup ---------------------------------------------------


def test_plain_otel_sdk_exporters_share_one_event_file(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_tracking.exporters.tensorboard import (
        TensorboardLogExporter,
        TensorboardMetricExporter,
        TensorboardSpanExporter,
    )

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "ml.project=sdkproj,ml.experiment=sdkexp")
    metric_exporter = TensorboardMetricExporter()
    span_exporter = TensorboardSpanExporter()
    log_exporter = TensorboardLogExporter()
    assert metric_exporter.session is span_exporter.session is log_exporter.session

    app = PlainSdk(metric_exporter, span_exporter, log_exporter)
    for step, value in ((3, 0.5), (4, 0.25)):
        app.log_step(step, {"loss": value})
    app.span("rollout", **{"ml.step": 4})
    app.span("plain")  # no ml.step: the last step exported
    app.emit(
        "ml.validation.generations",
        {"samples": SAMPLES},
        {"ml.step": 10, "ml.key": "val/generations", "ml.backends": ["tensorboard"]},
    )
    app.shutdown()
    assert metric_exporter.session.closed

    scalars, texts, _ = read_events(isolated / "tensorboard_log" / "sdkproj" / "sdkexp")
    assert without_timings(scalars) == {"loss": [(3, 0.5), (4, 0.25)]}
    assert [step for step, _ in scalars["timing_s/state/rollout"]] == [4]
    assert [step for step, _ in scalars["timing_s/state/plain"]] == [4]
    assert texts == {TEXT_TAG: [(10, EXPECTED_TEXT)]}


# --- against the reference ---------------------------------------------------------------------


class RecordingSummaryWriter:
    """Stands in for torch's SummaryWriter: records the calls, and raises where torch raises (its
    ``add_scalar`` makes a float of the value, so strings, None and lists fail)."""

    calls: list[tuple[str, str, int, Any]] = []
    log_dirs: list[str] = []

    def __init__(self, log_dir: str | None = None, **_: Any) -> None:
        type(self).log_dirs.append(str(log_dir))

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, (str, bytes)) or not isinstance(value, (int, float)):
            raise ValueError(f"torch.utils.tensorboard cannot make a scalar of {value!r}")
        type(self).calls.append(("scalar", tag, step, value))

    def add_text(self, tag: str, text: str, step: int) -> None:
        type(self).calls.append(("text", tag, step, text))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> type[RecordingSummaryWriter]:
    RecordingSummaryWriter.calls = []
    RecordingSummaryWriter.log_dirs = []
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = RecordingSummaryWriter  # type: ignore[attr-defined]
    for name in ("torch", "torch.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    return RecordingSummaryWriter


def what_torch_stores(
    calls: list[tuple[str, str, int, Any]],
) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[tuple[int, str]]]]:
    scalars: dict[str, list[tuple[int, float]]] = {}
    texts: dict[str, list[tuple[int, str]]] = {}
    for kind, tag, step, value in calls:
        if kind == "scalar":
            scalars.setdefault(tag, []).append((step, f32(float(value))))
        else:
            texts.setdefault(tag + "/text_summary", []).append((step, value))
    return scalars, texts


def test_differential_against_the_reference(
    isolated: Path,
    seed: types.ModuleType,
    fake_torch: type[RecordingSummaryWriter],
    capfd: pytest.CaptureFixture[str],
) -> None:
    from otel_tracking import Tracking, ValidationGenerationsLogger

    reference = seed.Tracking("proj", "exp", default_backend="tensorboard", config=CONFIG)
    reference_out = capfd.readouterr().out
    for data, step in steps_payloads():
        reference.log(data, step)
    seed.ValidationGenerationsLogger("proj", "exp").log(["tensorboard"], SAMPLES, 10)
    reference.finish()
    # The reference's scalar adapter and its generations logger both chose this directory.
    assert fake_torch.log_dirs == ["tensorboard_log/proj/exp", "tensorboard_log/proj/exp"]
    reference_scalars, reference_texts = what_torch_stores(fake_torch.calls)

    ours = Tracking("proj", "exp", default_backend="tensorboard", config=CONFIG)
    ours_out = capfd.readouterr().out
    for data, step in steps_payloads():
        ours.log(data, step)
    ValidationGenerationsLogger("proj", "exp").log(["tensorboard"], SAMPLES, 10)
    ours.finish()
    scalars, texts, _ = read_events(isolated / "tensorboard_log" / "proj" / "exp")

    assert_scalars(scalars, reference_scalars)
    assert texts == reference_texts == {TEXT_TAG: [(10, EXPECTED_TEXT)]}
    line = "Saving tensorboard log to tensorboard_log/proj/exp."
    assert line in reference_out and line in ours_out

    # Documented fix: a non-number value made the reference's add_scalar raise mid-step, losing the
    # keys after it (and raising into the training loop); the bridge skips it and keeps the rest.
    fake_torch.calls = []
    reference = seed.Tracking("proj", "exp2", default_backend="tensorboard")
    with pytest.raises(ValueError):
        reference.log({"a": 1.0, "note": "text", "b": 2.0}, 0)
    assert what_torch_stores(fake_torch.calls)[0] == {"a": [(0, 1.0)]}
    reference.finish()
    ours = Tracking("proj", "exp2", default_backend="tensorboard")
    ours.log({"a": 1.0, "note": "text", "b": 2.0}, 0)
    ours.finish()
    assert read_events(isolated / "tensorboard_log" / "proj" / "exp2")[0] == {"a": [(0, 1.0)], "b": [(0, 2.0)]}


def test_lanes_of_one_phase_are_one_value_per_step(isolated: Path) -> None:
    """Four rollout workers' ``generate`` spans in one step: TensorBoard keeps one value per (tag,
    step), so four values of one tag would show one lane at random.  The bridge writes the phase's
    wall time (first start to last end) and its slowest lane, once per step."""
    import contextvars
    import threading

    from otel_tracking import Tracking, trace_state

    tracking = Tracking("proj", "lanes", default_backend=["tensorboard", "file"])
    for step in (1, 2, 3):
        with trace_state("rollout", step=step):
            threads = []
            for lane in range(4):
                run = contextvars.copy_context().run
                threads.append(threading.Thread(target=run, args=(_lane, lane, step)))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        tracking.log({"loss": 1.0 / step}, step)
    tracking.finish()

    scalars, _, _ = read_events(isolated / "tensorboard_log" / "proj" / "lanes")
    events = [json.loads(line) for line in (isolated / "proj" / "lanes.events.jsonl").read_text().splitlines()]
    for step in (1, 2, 3):
        lanes = [e for e in events if e["name"] == "generate" and e["attributes"]["ml.step"] == step]
        assert len(lanes) == 4  # each lane's own span stays in the spans
        wall = (max(e["end_time_unix_nano"] for e in lanes) - min(e["start_time_unix_nano"] for e in lanes)) / 1e9
        slowest = max(e["duration_s"] for e in lanes)
        assert [v for s, v in scalars["timing_s/state/generate"] if s == step] == pytest.approx([f32(wall)])
        assert [v for s, v in scalars["timing_s/state/generate/slowest"] if s == step] == pytest.approx([f32(slowest)])
    assert [s for s, _ in scalars["timing_s/state/rollout"]] == [1, 2, 3]
    assert "timing_s/state/rollout/slowest" not in scalars  # one span a step: no lanes to compare


def _lane(lane: int, step: int) -> None:
    from otel_tracking import trace_state

    with trace_state("generate", state_lane_id=lane, step=step):
        pass


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=4096))
def test_the_c_checksum_is_tensorboards_own(data: bytes) -> None:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards

    from otel_tracking.compat.tensorboard_internals import masked_crc32c

    assert masked_crc32c(data) == tensorboards(data)


def test_the_bridge_process_writes_records_tensorboards_checksum_accepts(isolated: Path) -> None:
    """The bridge process checksums in C; every record of its event file verifies with
    TensorBoard's own (pure-Python) checksum, and this process's TensorBoard is left as it was."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards
    from tensorboard.summary.writer import record_writer

    from otel_tracking import Tracking

    tracking = Tracking("proj", "exp", default_backend="tensorboard")
    for step in range(20):
        tracking.log({f"m{k}": step + k / 10 for k in range(50)}, step)
    tracking.finish()
    (path,) = (isolated / "tensorboard_log" / "proj" / "exp").glob("events.out.tfevents.*")
    raw, records, at = path.read_bytes(), 0, 0
    while at < len(raw):
        header = raw[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", raw[at + 8 : at + 12])
        data = raw[at + 12 : at + 12 + length]
        (data_crc,) = struct.unpack("<I", raw[at + 12 + length : at + 16 + length])
        assert (header_crc, data_crc) == (tensorboards(header), tensorboards(data)), f"record {records}"
        at += 16 + length
        records += 1
    assert records == 21, "the file-version event and one event per step"
    assert record_writer.masked_crc32c is tensorboards, "the training process's TensorBoard is untouched"
    scalars, _, _ = read_events(isolated / "tensorboard_log" / "proj" / "exp")
    assert scalars["m3"] == [(step, pytest.approx(step + 0.3)) for step in range(20)]
