"""The Tracking facade: verl's API, and what we do better, read back from the file sink."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from otel_tracking import ConfigError, Tracking
from otel_tracking.config.trackers import TRACKERS
from otel_tracking.delivery.registry import SUPPORTED_BACKENDS

REFERENCE_BACKENDS = [
    "wandb",
    "mlflow",
    "swanlab",
    "vemlp_wandb",
    "tensorboard",
    "console",
    "clearml",
    "trackio",
    "file",
    "rl_insight",
]


def records(path: Path) -> list[tuple[int, dict]]:
    return [(line["step"], line["data"]) for line in map(json.loads, path.read_text().splitlines())]


def test_supported_backend_names_match_the_reference(seed) -> None:
    # verl's names in verl's order; a tracker of ours that verl does not know may only follow them
    assert seed.Tracking.supported_backend == REFERENCE_BACKENDS
    ours = [name for name in TRACKERS if name not in REFERENCE_BACKENDS]
    assert Tracking.supported_backend == list(SUPPORTED_BACKENDS) == REFERENCE_BACKENDS + ours


def test_unknown_backend_is_a_value_error_listing_the_supported_names() -> None:
    with pytest.raises(ValueError) as caught:
        Tracking("p", "e", default_backend=["console", "neptune"])
    message = str(caught.value)
    assert "'neptune'" in message
    for name in REFERENCE_BACKENDS:
        assert name in message


def test_deprecated_tracking_alias_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    import otel_tracking.api.facade as facade

    # The alias means wandb; check the warning without opening a wandb run.
    with pytest.warns(DeprecationWarning, match="`tracking` logger is deprecated. use `wandb` instead."):
        assert facade._backend_names(["tracking", "console"]) == ["wandb", "console"]


def test_log_writes_exact_keys_steps_and_values(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend=["file"])
    key = "val-core/openai/gsm8k/reward/mean@4"
    for step in range(1, 21):
        data = {"train/loss": 1.0 / step}
        if step % 10 == 0:
            data[key] = step / 100
        tracking.log(data, step)
    tracking.finish()
    got = records(isolated / "proj" / "exp.jsonl")
    assert len(got) == 20
    assert [step for step, data in got if key in data] == [10, 20], "a key logged every 10 steps appears only there"
    assert got[9] == (10, {"train/loss": 0.1, key: 0.1})


def test_repeated_and_backward_steps_are_kept_as_given(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")
    for step, value in [(5, 1.0), (5, 2.0), (3, 3.0), (0, 4.0), (-1, 5.0)]:
        tracking.log({"x": value}, step)
    tracking.finish()
    assert records(isolated / "proj" / "exp.jsonl") == [
        (5, {"x": 1.0}),
        (5, {"x": 2.0}),
        (3, {"x": 3.0}),
        (0, {"x": 4.0}),
        (-1, {"x": 5.0}),
    ]


class TorchLikeScalar:
    """What torch scalars offer: item() and a 0-d shape (torch itself is not installed here)."""

    ndim = 0

    def __init__(self, value: float) -> None:
        self._value = value

    def item(self) -> float:
        return self._value


def test_numbers_of_every_kind_and_non_numbers(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tracking = Tracking("proj", "exp", default_backend=["file", "console"])
    tracking.log(
        {
            "f": 0.5,
            "i": 3,
            "b": True,
            "np_f32": np.float32(0.25),
            "np_i64": np.int64(7),
            "np_bool": np.bool_(False),
            "zero_d": np.array(1.5),
            "torch_like": TorchLikeScalar(2.5),
            "nan": float("nan"),
            "inf": float("inf"),
            "big": 2**70,
            "text": "hello",
            "none": None,
            "list": [1, 2],
            "nested": {"a": {"b": 1}},
            "vector": np.array([1.0, 2.0]),
        },
        step=np.int64(4),
    )
    tracking.finish()
    ((step, data),) = records(isolated / "proj" / "exp.jsonl")
    assert step == 4
    assert data == {
        "f": 0.5,
        "i": 3,
        "b": True,
        "np_f32": 0.25,
        "np_i64": 7,
        "np_bool": False,
        "zero_d": 1.5,
        "torch_like": 2.5,
        "nan": None,
        "inf": None,
        "big": float(2**70),
        "text": "hello",
        "none": None,
        "list": [1, 2],
        "nested": {"a": {"b": 1}},
        "vector": [1.0, 2.0],
    }
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step:"))
    assert line == (
        # numpy scalars as pprint shows them, as the reference printed them (issue 21)
        "step:4 - f:0.5 - i:3 - b:True - np_f32:np.float32(0.25) - np_i64:np.int64(7) - np_bool:False - zero_d:1.5"
        " - torch_like:2.5"
        f" - nan:nan - inf:inf - big:{float(2**70)!r}"
    )


def test_bad_keys_and_steps_get_clear_errors_and_keep_earlier_data(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend="file")
    tracking.log({"ok": 1}, 1)
    with pytest.raises(TypeError, match="keys must be str, got int key 3"):
        tracking.log({3: 1.0}, 2)
    with pytest.raises(TypeError, match="step must be an integer, got str 'x'"):
        tracking.log({"a": 1.0}, "x")
    with pytest.raises(TypeError, match=r"step must be an integer, got float 1\.5"):
        tracking.log({"a": 1.0}, 1.5)
    with pytest.raises(TypeError, match="data must be a mapping"):
        tracking.log([("a", 1.0)], 3)
    tracking.log({"ok": 2}, 2.0)
    tracking.finish()
    assert records(isolated / "proj" / "exp.jsonl") == [(1, {"ok": 1}), (2, {"ok": 2})]


def test_backend_filter_in_log(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tracking = Tracking("proj", "exp", default_backend=["file", "console"])
    tracking.log({"a": 1}, 1, backend=["file"])
    tracking.log({"a": 2}, 2, backend="console")
    tracking.log({"a": 3}, 3)
    tracking.finish()
    assert records(isolated / "proj" / "exp.jsonl") == [(1, {"a": 1}), (3, {"a": 3})]
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")] == [
        "step:2 - a:2",
        "step:3 - a:3",
    ]


def test_config_none_and_context_manager_exit_codes(isolated: Path) -> None:
    codes: list[int] = []
    with Tracking("proj", "ok", default_backend="file", config=None) as tracking:
        tracking.logger["file"]._on_finish = codes.append
        tracking.log({"x": 1}, 1)
    with pytest.raises(RuntimeError), Tracking("proj", "boom", default_backend="file") as tracking:
        tracking.logger["file"]._on_finish = codes.append
        tracking.log({"x": 1}, 1)
        raise RuntimeError("training crashed")
    assert codes == [0, 1]
    assert records(isolated / "proj" / "boom.jsonl") == [(1, {"x": 1})]


def test_finish_is_idempotent_and_returns_counts(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend=["file", "console"])
    tracking.log({"x": 1}, 1)
    first = tracking.finish()
    assert first["file"]["delivered"] == 1 and first["file"]["failed"] == 0
    assert tracking.finish() == first
    tracking.log({"x": 2}, 2)  # after finish: ignored, not an error
    assert records(isolated / "proj" / "exp.jsonl") == [(1, {"x": 1})]


def test_a_dropped_tracking_is_finished_at_exit_not_in_a_finalizer(tmp_path: Path) -> None:
    """No work in __del__ (a finish() there could wait 30 s inside the garbage collector): a
    Tracking dropped without finish() keeps its run, and the exit hook finishes it, once."""
    script = textwrap.dedent(
        """
        import gc
        from otel_tracking import Tracking
        from otel_tracking.runtime.run import current_run

        t = Tracking("proj", "exp", default_backend="file")
        t.logger["file"]._on_finish = lambda code: print(f"finished with {code}", flush=True)
        t.log({"x": 1}, 1)
        del t
        gc.collect()
        print("collected; open run:", current_run() is not None, flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2:] == ["collected; open run: True", "finished with 0"]
    assert not hasattr(Tracking, "__del__")


def test_unwritable_file_directory_is_one_clear_error(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = isolated / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(blocker))
    with pytest.raises(ConfigError, match="backend 'file' cannot write"):
        Tracking("proj", "exp", default_backend="file")


def test_a_failing_sink_never_stops_the_others(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tracking = Tracking("proj", "exp", default_backend=["console", "file"])

    def broken(_data):
        raise OSError("disk on fire")

    tracking.logger["console"].metrics.write = broken  # the console write fails, whichever way it is called
    tracking.log({"x": 1.0}, 1)
    tracking.log({"x": 2.0}, 2)
    stats = tracking.finish()
    assert records(isolated / "proj" / "exp.jsonl") == [(1, {"x": 1.0}), (2, {"x": 2.0})]
    assert stats["console"]["failed"] == 2 and stats["file"]["delivered"] >= 2


def test_unfinished_run_is_finished_at_exit_after_flushing(tmp_path: Path) -> None:
    """An unfinished run is finished once at exit, before any atexit hook a backend registered
    (wandb.init registers one, before or after ours): sinks flush into backends still open."""
    script = textwrap.dedent(
        """
        import atexit
        from otel_tracking import Tracking, trace_state

        atexit.register(lambda: print("earlier-registered hook ran", flush=True))
        t = Tracking("proj", "exp", default_backend="file")
        atexit.register(lambda: print("later-registered hook ran", flush=True))
        t.logger["file"]._on_finish = lambda code: print(f"file sink finished with {code}", flush=True)
        for step in range(3):
            with trace_state("phase"):
                t.log({"x": step}, step)
        # no finish(): the interpreter exits
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines.index("file sink finished with 0") < lines.index("later-registered hook ran")
    assert lines.index("file sink finished with 0") < lines.index("earlier-registered hook ran")
    assert lines.count("file sink finished with 0") == 1
    assert records(tmp_path / "proj" / "exp.jsonl") == [(0, {"x": 0}), (1, {"x": 1}), (2, {"x": 2})]
    events = (tmp_path / "proj" / "exp.events.jsonl").read_text().splitlines()
    # log() inside the phase closes the step, yet its root span ends after the phase (it encloses it)
    assert [json.loads(e)["name"] for e in events] == ["phase", "ml.step"] * 3


def test_nan_is_stored_by_the_reference_rule_in_json(isolated: Path) -> None:
    """JSON has no NaN: the file sink writes null exactly as the reference's orjson dump did."""
    tracking = Tracking("proj", "exp", default_backend="file")
    tracking.log({"loss": math.nan, "inf": -math.inf}, 1)
    tracking.finish()
    assert (isolated / "proj" / "exp.jsonl").read_text() == '{"step":1,"data":{"loss":null,"inf":null}}\n'
