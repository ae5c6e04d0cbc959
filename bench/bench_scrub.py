"""Secret scrubbing on adversarial text: is it linear, and what does 1 MB cost?

    python bench/bench_scrub.py                 # prints a table; --out FILE writes it as markdown too

Each input is a run of one thing the patterns look for (``=``, ``a=``, ``eyJ``, ``://``, ...) after
"The answer is " (a collapsed generation), at 64 kB and at 1 MB: the best of three
``scrub_value`` calls each, and their ratio (16 when the cost is linear in the length, 256 when it
is quadratic).  Then ``Tracking.log`` (file sink) of a 60 kB collapsed generation string, the
case the issue measured at 19 s, beside ``log()`` of a plain 60 kB string.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otel_tracking.signals.redact import scrub_value

UNITS = ["=", "a=", "password=", "eyJ", "://", "@", "Bearer ", "sk-", "hf_", "-----BEGIN RSA PRIVATE KEY-----", "x"]


def best(text: str, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        scrub_value(text)
        times.append(time.perf_counter() - started)
    return min(times)


def log_cost(value: str, steps: int = 20) -> float:
    from otel_tracking import Tracking

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        tracking = Tracking("bench", "scrub", default_backend=["file"])
        times = []
        for step in range(steps):
            started = time.perf_counter()
            tracking.log({"val/generation": value}, step=step)
            times.append(time.perf_counter() - started)
        tracking.finish()
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = args.out.resolve() if args.out else None  # log_cost changes the working directory
    rows = ["| input (repeated) | 64 kB, ms | 1 MB, ms | ratio (linear: 16) |", "|---|---|---|---|"]
    for unit in UNITS:
        small = best("The answer is " + unit * (65_536 // len(unit)))
        large = best("The answer is " + unit * (1_048_576 // len(unit)))
        rows.append(f"| `{unit!r}` | {small * 1e3:.2f} | {large * 1e3:.1f} | {large / small:.1f} |")
    collapsed = log_cost("The answer is " + "=" * 60_000)
    plain = log_cost("The answer is " + "x" * 60_000)
    rows += [
        "",
        f"`Tracking.log` (file sink) of a 60 kB collapsed generation (`'The answer is ===...'`): p50 "
        f"{collapsed * 1e3:.2f} ms; of a plain 60 kB string: {plain * 1e3:.2f} ms.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}.",
    ]
    text = "\n".join(rows)
    print(text)
    if out:
        command = f"python bench/bench_scrub.py --out {args.out}"
        out.write_text(f"# Scrubbing on adversarial text\n\nCommand: `{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
