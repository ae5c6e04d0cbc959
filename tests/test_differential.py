"""The same calls to the reference (verl's tracking.py) and to otel_tracking give the same file
records and the same console lines."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.resources import Resource

from otel_tracking import Tracking


def calls() -> list[tuple[dict, int]]:
    rng = random.Random(7)
    result: list[tuple[dict, int]] = []
    for step in [0, 1, 2, 2, 5, 4, 10, 11]:  # a repeated and a backward step
        data: dict = {f"actor/metric_{i}": rng.uniform(-1e3, 1e3) for i in range(25)}
        data.update({"critic/score/mean": rng.random(), "response_length/max": rng.randint(0, 4096)})
        data.update({"tiny": 1e-300, "huge": 1.7e308, "neg_int": -3, "flag": step % 2 == 0})
        if step % 10 == 0:
            data["val-core/openai/gsm8k/reward/mean@4"] = rng.random()
        result.append((data, step))
    result.append(({}, 12))  # an empty log() still writes a line
    return result


def run(factory, root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(root))
    tracking = factory("proj", "exp", default_backend=["console", "file"], config=None)
    for data, step in calls():
        tracking.log(data=data, step=step)
    tracking.finish()
    out = capsys.readouterr().out.splitlines()
    console = [line for line in out if line.startswith("step:")]
    file_lines = (root / "proj" / "exp.jsonl").read_text().splitlines()
    return console, [json.loads(line) for line in file_lines], file_lines, out


def test_file_and_console_match_the_reference(
    seed, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ref_console, ref_records, ref_raw, ref_out = run(seed.Tracking, tmp_path / "ref", capsys, monkeypatch)
    our_console, our_records, our_raw, our_out = run(Tracking, tmp_path / "ours", capsys, monkeypatch)
    assert len(ref_records) == len(calls())
    assert our_records == ref_records
    assert our_raw == ref_raw, "byte-identical lines for plain numbers"
    assert our_console == ref_console
    assert any(line.startswith("Creating file logger at ") for line in ref_out)
    assert any(line.startswith("Creating file logger at ") for line in our_out)


def test_mixed_values_keep_the_callers_key_order_as_the_reference(
    seed, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Numbers and other values interleaved: the file line is the reference's, byte for byte."""
    lines = {}
    for name, factory in (("ref", seed.Tracking), ("ours", Tracking)):
        monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / name))
        tracking = factory("proj", "exp", default_backend=["file"], config=None)
        tracking.log(data={"note": "warmup", "loss": 0.5, "cfg": {"lr": 1e-6, "tags": ["a"]}, "acc": 0.9}, step=3)
        tracking.log(data={"loss": 0.25, "acc": 1, "note": None}, step=4)
        tracking.finish()
        lines[name] = (tmp_path / name / "proj" / "exp.jsonl").read_text()
    capsys.readouterr()
    assert lines["ours"] == lines["ref"]
    assert lines["ours"].startswith('{"step":3,"data":{"note":"warmup","loss":0.5,"cfg":')


def test_a_one_element_array_is_not_a_gauge_as_in_the_reference(
    seed, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The docs' rule (log-rules.md): ndim 0 with item() is a number; np.array([1.5]) is not (the reference's
    console leaves it out, its file writes [1.5]): the same lines from both."""
    import numpy as np

    outputs = {}
    for name, factory in (("ref", seed.Tracking), ("ours", Tracking)):
        monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / name))
        capsys.readouterr()
        tracking = factory("proj", "exp", default_backend=["file", "console"], config=None)
        tracking.log(data={"one": np.array([1.5]), "x": 2.5}, step=1)
        tracking.finish()
        console = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")]
        outputs[name] = ((tmp_path / name / "proj" / "exp.jsonl").read_text(), console)
    assert outputs["ours"] == outputs["ref"]
    assert outputs["ours"] == ('{"step":1,"data":{"one":[1.5],"x":2.5}}\n', ["step:1 - x:2.5"])


def test_numpy_numbers_and_odd_steps_are_written_as_the_reference_wrote_them(
    seed, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's metrics are often numpy float32: the reference's orjson dump (OPT_SERIALIZE_NUMPY)
    writes np.float32(1.1) as 1.1, where the float64 it converts to is 1.100000023841858; a
    uint64 beyond int64 exactly; step=11.0 as 11.0 and step=True as true (issue 21).  The console
    prints them as the reference's pprint did."""
    import numpy as np

    calls = [
        ({"f32": np.float32(1.1), "f16": np.float16(0.1), "u64": np.uint64(2**63 + 5), "f": 0.5}, 1),
        ({"i8": np.int8(-3), "f64": np.float64(0.1), "i": 2**63 + 7, "t": "x", "f32": np.float32(2.5)}, 11.0),
        ({"u8": np.uint8(200), "neg": np.float32(-0.3)}, np.int64(12)),
        ({"x": 1.0}, np.float32(13.0)),
        ({"x": 2.0}, True),
    ]
    outputs = {}
    for name, factory in (("ref", seed.Tracking), ("ours", Tracking)):
        monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / name))
        capsys.readouterr()
        tracking = factory("proj", "exp", default_backend=["file", "console"], config=None)
        for data, step in calls:
            tracking.log(data=data, step=step)
        tracking.finish()
        console = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")]
        outputs[name] = ((tmp_path / name / "proj" / "exp.jsonl").read_bytes(), console)
    assert outputs["ours"][0] == outputs["ref"][0], "byte-identical file lines"
    assert outputs["ours"][1] == outputs["ref"][1], "the same console lines"
    first = outputs["ours"][0].splitlines()[0]
    assert first == b'{"step":1,"data":{"f32":1.1,"f16":0.099975586,"u64":9223372036854775813,"f":0.5}}'
    assert outputs["ours"][0].splitlines()[1].startswith(b'{"step":11.0,')
    assert outputs["ours"][0].splitlines()[4] == b'{"step":true,"data":{"x":2.0}}'


def test_what_the_trackers_get_for_numpy_numbers_and_odd_steps(tmp_path: Path) -> None:
    """Beside the file's exact text, every other sink gets the number and the int step."""
    import numpy as np

    from otel_tracking.signals.steps import StepBatch
    from otel_tracking.signals.values import split_values, step_as_logged, to_step

    scalars, others, logged = split_values({"f32": np.float32(1.1), "u64": np.uint64(2**63 + 5), "f": 0.5})
    assert scalars == {"f32": float(np.float32(1.1)), "u64": float(2**63 + 5), "f": 0.5} and not others
    assert logged is not None and set(logged) == {"f32", "u64"}
    for step, expected in ((11.0, 11), (True, 1), (np.int64(3), 3)):
        batch = StepBatch(
            Resource({}), to_step(step), scalars, {}, 0, as_logged=logged, step_as_logged=step_as_logged(step)
        )
        points = {
            m.name: m.data.data_points[0].value
            for m in batch.metrics_data().resource_metrics[0].scope_metrics[0].metrics
        }
        assert points["train.step"] == expected and type(points["train.step"]) is int
        assert points["f32"] == float(np.float32(1.1))


# Numbers as verl logs them (losses, rewards, counts) and at every magnitude, so both ways the
# console writes a number are taken: one orjson call for the whole line, or repr for each.
_typical = st.floats(-1e4, 1e4, allow_nan=False).map(lambda x: round(x, 4)) | st.floats(0, 1)
_edges = st.sampled_from([math.nan, math.inf, -math.inf, 1e-05, -2.5e-07, 1e16, 2**64 - 1, True, False])
_any_number = st.one_of(
    st.floats(),
    st.floats(-1e-3, 1e-3),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.booleans(),
    _typical,
    _edges,
)
_keys = st.text(alphabet="ab/_:- ", min_size=1, max_size=4)


def test_the_console_writes_every_number_as_the_reference_printed_it(
    seed, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each number as pprint wrote it in the reference: ``1e-05`` (not ``0.00001``), ``1e+16``,
    ``nan``, ``True``, an int past 64 bits, and plain floats in between."""
    monkeypatch.chdir(tmp_path)
    ours = Tracking("proj", "exp", default_backend="console")
    reference = seed.Tracking("proj", "exp", default_backend="console")

    @settings(max_examples=400, deadline=None)
    @given(
        data=st.one_of(
            st.dictionaries(_keys, _typical, max_size=12),  # no number that orjson writes otherwise
            st.dictionaries(_keys, _typical | _edges, max_size=12),  # among them, one that it does
            st.dictionaries(_keys, _any_number, max_size=12),
        ),
        step=st.integers(0, 10**6),
    )
    def check(data: dict, step: int) -> None:
        capsys.readouterr()
        ours.log(data, step)
        ours_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")]
        reference.log(data, step)
        reference_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")]
        assert ours_lines == reference_lines

    try:
        check()
    finally:
        ours.finish()
        reference.finish()
