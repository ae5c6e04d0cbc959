"""The same calls to the reference (verl's tracking.py) and to otel_tracking give the same file
records and the same console lines."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

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
    """The README's rule: ndim 0 with item() is a number; np.array([1.5]) is not (the reference's
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
