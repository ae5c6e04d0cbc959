"""A model-based test of a training script's process-level habits with the library switched on.

Hypothesis draws a script: its own SIGTERM handler (none, installed before ``Tracking()`` or after
it), logging threads that end in any order, a fork child that is terminated, SIGTERM at no time,
during training or inside ``finish()`` (an endpoint that takes nothing keeps it draining).  Each is
run as a real script.  The invariants: the process ends as it would without the library (the exit
code the script's own logic gives: 0, its handler's 3, or 143 for SIGTERM without a handler), its
handler ran when SIGTERM came, and every ``log()`` it returned from is in the file sink.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.otlp_receiver import HttpReceiver
from tests.servers import DelayProxy

SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, sys, threading, time
    from otel_tracking import Tracking

    def say(text):  # one write per line: lines of several threads never run into each other
        os.write(1, (text + "\\n").encode())

    plan = json.loads(sys.argv[1])
    stop = threading.Event()

    def checkpoint_then_stop(signum, frame):
        say("handled")
        stop.set()

    def helper():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a helper of its own, as careful scripts do
        time.sleep(30)

    if plan["handler"] == "before":
        signal.signal(signal.SIGTERM, checkpoint_then_stop)
    t = Tracking("proj", "exp", default_backend="file")
    if plan["handler"] == "after":
        signal.signal(signal.SIGTERM, checkpoint_then_stop)

    def train(name, steps):
        for step in range(steps):
            if stop.is_set():
                return
            t.log({name: float(step)}, step)
            say(f"logged {name} {step}")
            time.sleep(0.02)

    threads = [threading.Thread(target=train, args=(f"t{k}", n)) for k, n in enumerate(plan["threads"])]
    for thread in threads:
        thread.start()
    if plan["fork"]:
        child = multiprocessing.get_context("fork").Process(target=helper)
        child.start()
        child.terminate()
        child.join()
    train("main", plan["main_steps"])
    if stop.is_set():
        sys.exit(3)  # checkpointed: the script's own exit code
    if plan["join"]:  # the threads are done, then finish() explicitly
        for thread in threads:
            thread.join()
        say("finishing")
        t.finish()
        say("end")
    # else the main thread returns while the threads may still train: the run ends at exit
    """
)

plans = st.fixed_dictionaries(
    {
        "handler": st.sampled_from(["none", "before", "after"]),
        "threads": st.lists(st.integers(1, 15), max_size=2),
        "fork": st.booleans(),
        "main_steps": st.integers(5, 25),
        "join": st.booleans(),
        "sigterm": st.sampled_from(["never", "training", "finish"]),
    }
).map(lambda plan: {**plan, "join": plan["join"] or plan["sigterm"] == "finish"})  # finish() is called then


def _expected_exit(plan: dict[str, Any]) -> int:
    """What the script's own logic gives, as the shell shows it."""
    if plan["sigterm"] == "never":
        return 0
    if plan["handler"] == "none":
        return 128 + signal.SIGTERM
    return 3 if plan["sigterm"] == "training" else 0  # in finish(): past its check, it ends normally


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans)
def test_the_process_ends_as_without_the_library_and_every_returned_log_is_written(
    tmp_path_factory: Any, plan: dict[str, Any]
) -> None:
    cwd = tmp_path_factory.mktemp("habits")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_TRACKING_SPOOL_DIR"] = str(cwd / "spool")
    with HttpReceiver() as receiver, DelayProxy(receiver.port, gate=threading.Event()) as hung:
        if plan["sigterm"] == "finish":  # an endpoint that takes nothing: finish() drains for 3 s
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{hung.port}"
            env["OTEL_TRACKING_FINISH_TIMEOUT"] = "3"
        process = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, json.dumps(plan)], cwd=cwd, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stdout is not None
        lines = []
        trigger = {"training": "logged main 2", "finish": "finishing"}.get(plan["sigterm"])
        for line in process.stdout:
            lines.append(line.strip())
            if line.strip() == trigger:
                process.send_signal(signal.SIGTERM)
                break
        out, err = process.communicate(timeout=120)
    lines += out.splitlines()
    code = process.returncode if process.returncode >= 0 else 128 - process.returncode
    assert code == _expected_exit(plan), (plan, lines, err[-3000:])
    if plan["sigterm"] != "never" and plan["handler"] != "none":
        assert "handled" in lines, (plan, lines)
    returned = {(name, int(step)) for name, step in (line.split()[1:] for line in lines if line.startswith("logged "))}
    written = set()
    for raw in (cwd / "proj" / "exp.jsonl").read_text().splitlines():
        record = json.loads(raw)
        written |= {(name, record["step"]) for name in record["data"]}
    assert returned <= written, (plan, sorted(returned - written), err[-2000:])
