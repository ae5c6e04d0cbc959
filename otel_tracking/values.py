"""The rules for what ``log(data, step)`` accepts, in one place.

Numbers (become gauge points):
- ``int``, ``float`` and ``bool`` as they are (a bool stays a bool, so sinks print ``True``/``true``
  exactly as the reference did; OTLP carries it as 1/0);
- numpy scalars, 0-d arrays, torch scalars and anything else with a scalar ``item()``: ``item()``;
- other ``numbers.Real``/``numbers.Number`` (``Fraction``, ``Decimal``): ``float()``;
- ints outside int64 become floats (OTLP has no bigger integer);
- NaN and +/-inf are kept (every sink that can store them gets them).

Everything else (``None``, strings, lists, dicts, arrays with more than one element, complex
numbers, ...) is not a number: it is never turned into a gauge, but it is kept and reaches the file
sink in the metrics line exactly as the reference's ``orjson`` dump wrote it.  Where that dump
raised, we write instead: scalars nested inside (0-d arrays, tensors) as their number, other arrays
and tensors as lists, ints beyond 64 bits as floats, anything else as its ``str()``.

Strings, wherever they are in a value, have credentials cut out (``redact.scrub_strings``: URL
userinfo, ``name=value`` pairs with a secret name, known key formats); nothing else changes.

Keys must be ``str`` (a ``TypeError`` names the bad key); steps must be integers (``int``, numpy
ints, integral floats such as ``3.0``) or a ``TypeError`` names the step.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

import orjson

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_EXTRAS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def to_number(value: Any) -> int | float | None:
    """The gauge value for ``value``, or None when it is not a number."""
    kind = type(value)
    if kind is float or kind is bool:
        return value
    if kind is int:
        return value if _INT64_MIN <= value <= _INT64_MAX else float(value)
    if isinstance(value, (str, bytes, dict, list, tuple, set)) or value is None:
        return None
    if isinstance(value, numbers.Integral):
        return to_number(int(value))
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, numbers.Number):  # Decimal, complex
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:  # scalars and 0-d arrays/tensors only
        try:
            scalar = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        if scalar is value or not isinstance(scalar, (int, float, numbers.Number)):
            return None
        return to_number(scalar)
    return None


def to_step(step: Any) -> int:
    """The integer step, or a TypeError naming what was given."""
    if type(step) is int:
        return step
    if isinstance(step, bool):
        raise TypeError(f"log() step must be an integer, got bool {step!r}")
    if isinstance(step, numbers.Integral):
        return int(step)
    value = to_number(step)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"log() step must be an integer, got {type(step).__name__} {step!r}")


def split_values(data: Mapping[str, Any]) -> tuple[dict[str, int | float], dict[str, Any]]:
    """Split one log() payload into (numbers, everything else), keeping the caller's key order."""
    if not isinstance(data, Mapping):
        raise TypeError(f"log() data must be a mapping of str keys to values, got {type(data).__name__}")
    scalars: dict[str, int | float] = {}
    others: dict[str, Any] = {}
    for key, value in data.items():
        if type(key) is not str:
            raise TypeError(f"log() keys must be str, got {type(key).__name__} key {key!r}")
        number = to_number(value)
        if number is None:
            others[key] = value
        else:
            scalars[key] = number
    return scalars, others


def encode_others(others: Mapping[str, Any]) -> str:
    """JSON text for the non-number values, as the file sink will write them."""
    try:
        return orjson.dumps(others, default=_json_default, option=_EXTRAS_OPTIONS).decode()
    except orjson.JSONEncodeError:  # an int beyond 64 bits somewhere inside: orjson cannot write it
        return orjson.dumps(_ints_to_floats(others), default=_json_default, option=_EXTRAS_OPTIONS).decode()


def _json_default(value: Any) -> Any:
    """For what orjson cannot write itself: scalars (0-d arrays, tensors) as their number, arrays and
    tensors as lists, anything else as its str()."""
    number = to_number(value)
    if number is not None:
        return number
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        try:
            return tolist()
        except Exception:
            pass
    return str(value)


def _ints_to_floats(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and not _INT64_MIN <= value < 2**64:
        return float(value)
    if isinstance(value, Mapping):
        return {k: _ints_to_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_ints_to_floats(v) for v in value]
    return value


def decode_others(text: str) -> dict[str, Any]:
    result = orjson.loads(text)
    return result if isinstance(result, dict) else {}


# --- OTel instrument names ---------------------------------------------------------------------

_INVALID_NAME_CHARS = re.compile(r"[^A-Za-z0-9_./\-]")
_MAX_NAME = 255


class InstrumentNames:
    """Makes a log() key a valid OTel instrument name, by one rule, where a name must be valid
    (the OTLP path; ML sinks get the key exactly as written):

    1. ``@`` becomes ``_at_`` (``mean@4`` -> ``mean_at_4``, as the MLflow bridge does);
    2. every other character outside ``A-Za-z0-9_./-`` becomes ``_``;
    3. a name that does not start with a letter gets the prefix ``m_``;
    4. the name is cut to 255 characters;
    5. a name already taken by a different key in this run gets ``_2``, ``_3``, ... (cut to fit).

    The original key travels as the metric's description, so nothing is lost.
    """

    def __init__(self) -> None:
        self._by_key: dict[str, str] = {}
        self._taken: set[str] = set()

    def __call__(self, key: str) -> str:
        name = self._by_key.get(key)
        if name is None:
            name = self._assign(key)
        return name

    def _assign(self, key: str) -> str:
        base = _INVALID_NAME_CHARS.sub("_", key.replace("@", "_at_"))
        if not base[:1].isascii() or not base[:1].isalpha():
            base = "m_" + base
        base = base[:_MAX_NAME]
        name, n = base, 1
        while name in self._taken:
            n += 1
            suffix = f"_{n}"
            name = base[: _MAX_NAME - len(suffix)] + suffix
        self._by_key[key] = name
        self._taken.add(name)
        return name
