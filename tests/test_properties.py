"""Property-based tests over log(): any input either lands by the documented rule or gets a clear
TypeError naming the key, and nothing accepted before is lost."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_tracking import Tracking
from otel_tracking.signals.redact import scrub_value

INT64 = (-(2**63), 2**63 - 1)

keys = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", " ", "a b", "val-core/openai/gsm8k/reward/mean@4", "ключ", "🙂", "x" * 300, "step", "a//b"]),
)
plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(INT64[1] - 2, 2**64 + 2),  # around int64 and uint64: the file writes them exactly up to 2**64 - 1
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
)
numpy_scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32).map(np.float32),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.floats(allow_nan=True, allow_infinity=True).map(np.float64),
    st.integers(*INT64).map(np.int64),
    st.booleans().map(np.bool_),
    st.floats(allow_nan=True).map(np.array),  # 0-d arrays
)
values = st.recursive(
    st.one_of(plain, numpy_scalars),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6,
)
steps = st.one_of(st.integers(*INT64), st.integers(-5, 5))


def expected(value: Any, nested: bool = False) -> Any:
    """What the file sink's JSON holds for a value, by the docs' rules (log-rules.md; independent of the code,
    but for credentials in strings, cut out by redact.py's rule, which test_secrets tests):
    ints are written as JSON ints up to 2**64 - 1 (as the reference's orjson dump did) and as
    floats beyond; numbers as the caller gave them (the file writes what the reference wrote)."""
    if isinstance(value, np.float32):
        return Float32(value)  # orjson writes float32 with float32's shortest repr, as the reference did
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return scrub_value(value)  # credentials cut out (redact.py's rule, tested in test_secrets)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if INT64[0] <= value <= 2**64 - 1 else float(value)
    if isinstance(value, list):
        return [expected(v, nested=True) for v in value]
    if isinstance(value, dict):
        return {k: expected(v, nested=True) for k, v in value.items()}
    raise AssertionError(f"unexpected generated value {value!r}")


class Float32(float):
    """An expected nested float32: equal when the JSON number reads back as the same float32."""


def same(a: Any, b: Any) -> bool:
    if isinstance(b, Float32):
        return (a is None and not math.isfinite(b)) or (isinstance(a, float) and np.float32(a) == np.float32(b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-7)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


def lines_of(path: Path) -> list[str]:
    # Lines end at "\n" only: keys may hold U+0085 or U+2028, which str.splitlines() would split on.
    return path.read_text().split("\n")[:-1]


@pytest.fixture
def run(isolated: Path):
    """One run per test function; hypothesis's examples share it (and so must not lose its lines)."""
    tracking = Tracking("proj", "exp", default_backend=["file"])
    yield tracking, isolated / "proj" / "exp.jsonl"
    tracking.finish()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.dictionaries(keys, values, max_size=8), step=steps)
def test_every_accepted_value_lands_by_the_rule(run, data: dict[str, Any], step: int) -> None:
    tracking, path = run
    before = len(lines_of(path))
    tracking.log(data, step)
    lines = lines_of(path)
    assert len(lines) == before + 1, "exactly one line per log() call"
    record = json.loads(lines[-1])
    assert record["step"] == step
    want = {k: expected(v) for k, v in data.items()}
    assert same(record["data"], want), (record["data"], want)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.dictionaries(st.one_of(st.integers(), st.none(), st.tuples(st.integers())), values, min_size=1, max_size=3),
    step=steps,
)
def test_non_str_keys_are_a_type_error_naming_the_key_and_record_nothing(run, data, step) -> None:
    tracking, path = run
    before = path.read_text()
    with pytest.raises(TypeError, match="keys must be str, got"):
        tracking.log(data, step)
    assert path.read_text() == before


def test_workers_survive_every_kind_of_value(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same odd values through a worker-fed sink (OTLP): nothing raises in the worker, all delivered."""
    from tests.otlp_receiver import HttpReceiver

    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("proj", "exp", default_backend="file")
        odd = {"nan": float("nan"), "big": 2**80, "np": np.float32(0.5), "text": "x", "none": None, "list": [1, [2]]}
        for step in range(50):
            tracking.log({**odd, f"k{step}": step}, -step)
        stats = tracking.finish()
        assert stats["otlp-metrics"]["failed"] == 0 and stats["otlp-metrics"]["dropped"] == 0
        gauges = receiver.received.last_gauges()
        assert gauges["big"] == float(2**80) and gauges["np"] == 0.5 and math.isnan(gauges["nan"])
        assert "text" not in gauges and gauges["train.step"] == -49


def _nest(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


# What some sink cannot write: nesting around orjson's limit, lone surrogates, ints past 64 bits,
# steps past int64 (issue 19, item 2).
hard_values = st.one_of(
    values,
    st.builds(_nest, st.integers(245, 260), plain),
    st.text(alphabet=st.characters(categories=["Cs", "Ll"]), min_size=1, max_size=4),
    st.integers(min_value=2**63 - 2, max_value=2**66),
    st.integers(max_value=-(2**63) + 2, min_value=-(2**66)),
)
hard_keys = st.one_of(keys, st.text(alphabet=st.characters(categories=["Cs", "Lu"]), min_size=1, max_size=3))
hard_steps = st.one_of(steps, st.integers(2**63 - 2, 2**65), st.booleans(), st.integers(-3, 3).map(float))


@pytest.fixture
def file_and_console(isolated: Path):
    tracking = Tracking("proj", "exp", default_backend=["file", "console"])
    yield tracking, isolated / "proj" / "exp.jsonl"
    tracking.finish()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.dictionaries(hard_keys, hard_values, max_size=4), step=hard_steps)
def test_every_call_either_lands_whole_or_raises_before_anything_is_recorded(
    file_and_console, capsys: pytest.CaptureFixture[str], data: dict[str, Any], step: Any
) -> None:
    """No half-recorded step: a TypeError leaves the file and the console as they were; a call that
    returns has its one line in each, whatever sink would have failed on it before."""
    tracking, path = file_and_console
    capsys.readouterr()
    before = lines_of(path)
    try:
        tracking.log(data, step)
    except TypeError:
        assert lines_of(path) == before
        assert capsys.readouterr().out == ""
        return
    lines = lines_of(path)
    assert len(lines) == len(before) + 1
    written = json.loads(lines[-1])["step"]
    assert written == step and type(written) is type(step), "the step as given: 11.0, true, as the reference"
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")]) == 1
