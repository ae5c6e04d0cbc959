"""The rules for what ``log(data, step)`` accepts, in one place.

Everything is checked when ``log()`` is called, before anything is recorded: a value that some sink
could not write raises there (``TypeError`` naming the key), or is converted by a rule below.

Numbers (become gauge points):
- ``int``, ``float`` and ``bool`` as they are (a bool stays a bool, so sinks print ``True``/``true``
  exactly as the reference did; OTLP carries it as 1/0);
- numpy scalars, 0-d arrays, torch scalars and anything else with a scalar ``item()``: ``item()``;
- other ``numbers.Real``/``numbers.Number`` (``Fraction``, ``Decimal``): ``float()``;
- ints outside int64 become floats for every tracker and OTLP (OTLP has no bigger integer);
- NaN and +/-inf are kept (every sink that can store them gets them).

The file and console sinks write a number as the caller gave it when that differs from the gauge
value: numpy scalars (``np.float32(1.1)`` is ``1.1`` in the file and ``np.float32(1.1)`` on the
console, as the reference's ``orjson`` dump and ``pprint`` wrote it) and ints between int64 and
uint64 (exact).  Ints beyond 64 bits are written as floats there too (the reference raised).

Everything else (``None``, strings, lists, dicts, arrays with more than one element, complex
numbers, ...) is not a number: it is never turned into a gauge, but it is kept and reaches the file
sink in the metrics line exactly as the reference's ``orjson`` dump wrote it.  Where that dump
raised, we write instead: scalars nested inside (0-d arrays, tensors) as their number, other arrays
and tensors as lists, ints beyond 64 bits as floats, anything else as its ``str()``.  What cannot be
written even so raises ``TypeError`` naming the key: a value nested more than 252 levels deep
(orjson's limit, 254, in the file's line), a value that contains itself, strings that are not
valid Unicode (lone surrogates).

Strings, wherever they are in a value, have credentials cut out (``redact.scrub_strings``: URL
userinfo, ``name=value`` pairs with a secret name, known key formats); nothing else changes.

Keys must be ``str`` and valid Unicode (a ``TypeError`` names the bad key).  Steps must be integers
that fit int64: ``int``, numpy ints, integral floats such as ``3.0``, and ``True``/``False``, which
the reference took too (trackers get 1/0; the file and console write the step as given, ``11.0``
or ``true``, as the reference did); anything else raises a ``TypeError`` naming the step.
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
        value = step
    elif isinstance(step, numbers.Integral):  # bool, numpy ints
        value = int(step)
    else:
        number = to_number(step)  # integral floats such as 3.0; 0-d arrays and tensors
        if not isinstance(number, (int, float)) or not math.isfinite(number) or number != int(number):
            raise TypeError(f"log() step must be an integer, got {type(step).__name__} {step!r}")
        value = int(number)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise TypeError(f"log() step must fit in a signed 64-bit integer, got {step!r}")
    return value


def as_logged(value: Any) -> Any:
    """``value`` itself when the file and console write it other than its gauge number (numpy
    scalars, ints between int64 and uint64, floats and bools given as a step), else None."""
    kind = type(value)
    if kind is int:
        return value if _INT64_MAX < value < 2**64 else None
    if kind.__module__ == "numpy" and isinstance(value, numbers.Number):  # scalars, immutable
        dtype = getattr(value, "dtype", None)
        if dtype is not None and dtype.kind in "biuf" and dtype.itemsize <= 8:  # what orjson writes
            return value
    return None


def step_as_logged(step: Any) -> Any:
    """What the file and console write as the step when it is not a plain int: ``11.0``, ``True``."""
    if type(step) is int:
        return None
    if type(step) in (float, bool):
        return step
    return as_logged(step)


def split_values(
    data: Mapping[str, Any],
) -> tuple[dict[str, int | float], dict[str, Any], dict[str, Any] | None]:
    """Split one log() payload into (numbers, everything else, the numbers as logged where the
    file and console write them differently), keeping the caller's key order."""
    if not isinstance(data, Mapping):
        raise TypeError(f"log() data must be a mapping of str keys to values, got {type(data).__name__}")
    # A run logs the same keys step after step, most often with only floats: keys checked once,
    # and such a step taken whole (a quarter of the time the loop below takes for 200 numbers).
    keys = tuple(data)
    if keys in _CHECKED_KEYS and set(map(type, keys)) == _STR and set(map(type, data.values())) <= _PLAIN:
        return dict(data), {}, None
    scalars: dict[str, int | float] = {}
    others: dict[str, Any] = {}
    logged: dict[str, Any] | None = None
    for key, value in data.items():
        if type(key) is not str:
            raise TypeError(f"log() keys must be str, got {type(key).__name__} key {key!r}")
        if not key.isascii():
            _check_unicode(key)
        kind = type(value)
        number = value if kind is float or kind is bool else to_number(value)
        if number is None:
            others[key] = value
            continue
        scalars[key] = number
        if kind is not float and kind is not bool:
            original = as_logged(value)
            if original is not None:
                if logged is None:
                    logged = {}
                logged[key] = original
    if len(_CHECKED_KEYS) >= 64:
        _CHECKED_KEYS.clear()
    _CHECKED_KEYS.add(keys)
    return scalars, others, logged


_CHECKED_KEYS: set[tuple[Any, ...]] = set()  # key lists lately found all str and valid Unicode
_PLAIN = frozenset((float, bool))
_STR = {str}  # (a str subclass equal to a checked key is no str key)


def _check_unicode(key: str) -> None:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise TypeError(f"log() key {key!r} is not valid Unicode (a lone surrogate); no sink can write it") from None


def encode_others(others: Mapping[str, Any]) -> str:
    """JSON text for the non-number values, as the file sink will write them."""
    try:
        return orjson.dumps(others, default=_json_default, option=_EXTRAS_OPTIONS).decode()
    except orjson.JSONEncodeError:  # an int beyond 64 bits somewhere inside: orjson cannot write it
        return orjson.dumps(_ints_to_floats(others), default=_json_default, option=_EXTRAS_OPTIONS).decode()


def checked_others(others: Mapping[str, Any]) -> str:
    """:func:`encode_others`, or a TypeError naming the key whose value no sink can write.  Encoded
    one level deeper than the values are (in a list), as the file line holds them, and the list's
    brackets cut off: orjson's depth limit is met here if anywhere."""
    try:
        return encode_others([others])[1:-1]  # type: ignore[arg-type]
    except (orjson.JSONEncodeError, RecursionError):
        pass
    for key, value in others.items():
        try:
            encode_others([{key: value}])  # type: ignore[arg-type]
        except (orjson.JSONEncodeError, RecursionError) as error:
            reason = str(error)
            if "Recursion" in reason or isinstance(error, RecursionError):
                reason = "it is nested more than 252 levels deep (or contains itself)"
            raise TypeError(f"log() value of {key!r} cannot be written: {reason}") from None
    raise TypeError("log() values cannot be written together")  # (not seen: each one alone could)


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

    1. ``@`` becomes ``_at_`` (``mean@4`` -> ``mean_at_4``, as the MLflow tracker does);
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
