"""The agent-loop and rollout-server hops continue the step's trace (issue 18, item 4).

verl's real agent loop (``AgentLoopManager`` -> ``AgentLoopWorker`` Ray actors ->
``LLMServerClient`` -> ``GlobalRequestLoadBalancer`` -> the servers' ``generate``) on a real Ray
cluster, in front of a stand-in for the vLLM server that lacks only the inference engine
(``stand_in_vllm_server.py``, loaded by verl's own module and class names from a copy of verl).
Spans are read back from a real OTLP endpoint.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.otlp_receiver import HttpReceiver, wait_for

HERE = Path(__file__).resolve().parent
STEPS = 3
SAMPLES = 4
STALE_STEP = 2  # served by weights of version 0 (run_agent_loop.py): one update behind
WEIGHTS = {1: 0, 2: 0, 3: 2}


@pytest.fixture(scope="module")
def verl_with_stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """verl 0.9.1 with the stand-in server in place of ``vllm_async_server.py`` (and an empty
    ``vllm_rollout/__init__.py``: verl's imports its vLLM ``ServerAdapter``, which needs vLLM)."""
    import verl

    root = tmp_path_factory.mktemp("verl-stand-in")
    shutil.copytree(Path(verl.__file__).parent, root / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    package = root / "verl/workers/rollout/vllm_rollout"
    shutil.copy(HERE / "stand_in_vllm_server.py", package / "vllm_async_server.py")
    (package / "__init__.py").write_text("")
    return root


def run(
    cluster: str, tmp: Path, verl_root: Path, env: dict[str, str], receiver: HttpReceiver | None, *args: str
) -> dict[str, Any]:
    """One run of the loop as its own job; its spans once all have arrived (``receiver``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_", "RAY_ADDRESS"))}
    clean.update(
        PYTHONPATH=os.pathsep.join(str(p) for p in (verl_root, HERE)),
        VERL_FILE_LOGGER_PATH=str(tmp / "metrics.jsonl"),
        OTEL_TRACKING_SPOOL_DIR=str(tmp / "spool"),
        **env,
    )
    out = tmp / "result.json"
    command = [sys.executable, str(HERE / "run_agent_loop.py"), "--address", cluster, "--out", str(out), *args]
    with open(tmp / "stderr", "w") as stderr:
        loop = subprocess.Popen(command, env=clean, cwd=tmp, stdin=subprocess.PIPE, stdout=stderr, stderr=stderr)
        try:
            wait_for(lambda: out.exists() or loop.poll() is not None, timeout_s=300, what="the loop's result")
            spans = arrived_spans(receiver) if receiver is not None and out.exists() else []
        finally:
            assert loop.stdin is not None
            loop.stdin.close()
            returncode = loop.wait(timeout=120)
    assert returncode == 0, (tmp / "stderr").read_text()[-4000:]
    result = json.loads(out.read_text())
    result["spans"] = spans
    result["stderr"] = (tmp / "stderr").read_text()
    return result


def arrived_spans(receiver: HttpReceiver) -> list[dict[str, Any]]:
    want = {"ml.step": STEPS, "gen": STEPS, "generate_sequences": STEPS * SAMPLES, "vllm_generate": STEPS * SAMPLES}

    def complete() -> list[dict[str, Any]] | None:
        spans = receiver.received.spans()
        got = Counter(s["name"] for s in spans)
        return spans if all(got[name] >= count for name, count in want.items()) else None

    return wait_for(complete, timeout_s=120, what=f"spans {want}")


@pytest.fixture(scope="module")
def off(cluster: str, verl_with_stand_in: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with HttpReceiver() as r:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": r.endpoint}
        result = run(cluster, tmp_path_factory.mktemp("off"), verl_with_stand_in, env, None)
        result["spans"] = r.received.spans()
    return result


def test_the_hops_continue_the_step_trace(
    cluster: str, verl_with_stand_in: Path, tmp_path: Path, off: dict[str, Any]
) -> None:
    with HttpReceiver() as receiver:
        env = {
            "OTEL_TRACKING_VERL": "1",
            "OTEL_TRACKING_VERL_SIMPLE_TIMER": "1",  # the agent loop's per-sample span, in the agent-loop worker
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        }
        on = run(cluster, tmp_path, verl_with_stand_in, env, receiver)
    assert "could not instrument" not in on["stderr"]
    assert on["results"] == off["results"]  # the same rollouts
    assert [r["weight_version"] for r in on["results"]] == [[WEIGHTS[s]] * SAMPLES for s in range(1, STEPS + 1)]

    spans = on["spans"]
    by_id = {s["span_id"]: s for s in spans}
    roots = {s["trace_id"]: s for s in spans if s["name"] == "ml.step" and s["parent_span_id"] is None}
    step_of = {trace: root["attributes"]["ml.step"] for trace, root in roots.items()}
    gens = {step_of[s["trace_id"]]: s for s in spans if s["name"] == "gen"}
    assert sorted(gens) == list(range(1, STEPS + 1))
    driver = gens[1]["resource"]["process.pid"]

    # Hop 1, driver -> AgentLoopWorker actors: the agent loop's spans hang under the step's gen.
    samples = [s for s in spans if s["name"] == "generate_sequences"]
    assert Counter(step_of[s["trace_id"]] for s in samples) == {step: SAMPLES for step in range(1, STEPS + 1)}
    for sample in samples:
        assert by_id[sample["parent_span_id"]] is gens[step_of[sample["trace_id"]]]
        assert sample["resource"]["process.pid"] != driver
        assert sample["resource"]["ml.run.id"] == on["run_id"]
    assert len({s["resource"]["process.pid"] for s in samples}) == 2  # two agent-loop workers

    # Hop 2, AgentLoopWorker -> LLMServerClient -> server: verl's own vllm_generate spans hang under
    # the agent loop's span that sent the request, in the servers' processes, lane replica_<n>.
    served = [s for s in spans if s["name"] == "vllm_generate"]
    assert len(served) == STEPS * SAMPLES
    fresh = [s for s in served if s["parent_span_id"] is not None]
    assert Counter(step_of[s["trace_id"]] for s in fresh) == {1: SAMPLES, 3: SAMPLES}
    for span in fresh:
        step = step_of[span["trace_id"]]
        parent = by_id[span["parent_span_id"]]
        assert parent["name"] == "generate_sequences" and parent["trace_id"] == span["trace_id"]
        assert span["resource"]["process.pid"] not in (driver, parent["resource"]["process.pid"])
        assert span["attributes"]["ml.lane"] in ("replica_0", "replica_1")
        assert span["attributes"]["ml.weight_version"] == WEIGHTS[step]
        assert span["attributes"].get("ml.step") == gens[step]["attributes"].get("ml.step")  # the driver's, carried
        assert span["links"] == []
        assert span["resource"]["ml.run.id"] == on["run_id"] and span["resource"]["ml.role"] == "rollout"

    # Served by older weights (the fully async case): a trace of its own, linked to the span that
    # dispatched it, with the weight version.
    stale = [s for s in served if s["parent_span_id"] is None]
    assert len(stale) == SAMPLES
    for span in stale:
        assert span["trace_id"] not in roots
        assert len(span["links"]) == 1
        trace_id, span_id = span["links"][0]
        dispatcher = by_id[span_id]
        assert dispatcher["name"] == "generate_sequences" and dispatcher["trace_id"] == trace_id
        assert step_of[trace_id] == STALE_STEP
        assert span["attributes"]["ml.weight_version"] == WEIGHTS[STALE_STEP]
        assert "ml.step" not in span["attributes"]
        assert span["resource"]["ml.run.id"] == on["run_id"]
    assert len({s["links"][0] for s in stale}) == SAMPLES  # each to its own request's dispatcher


def test_switched_off_is_verl_as_it_is(off: dict[str, Any]) -> None:
    assert off["spans"] == []
    assert off["run_id"] is None
    assert [r["weight_version"] for r in off["results"]] == [[WEIGHTS[s]] * SAMPLES for s in range(1, STEPS + 1)]


def test_ray_started_before_the_switch_still_generates(
    cluster: str, verl_with_stand_in: Path, tmp_path: Path, off: dict[str, Any]
) -> None:
    """``ray.init`` before ``import verl``: the workers are not instrumented, so no actor call gets a
    keyword it does not know; the rollouts are verl's."""
    on = run(cluster, tmp_path, verl_with_stand_in, {"OTEL_TRACKING_VERL": "1"}, None, "--ray-first")
    assert on["results"] == off["results"]
    assert on["stderr"].count("this Ray job's workers are not instrumented") == 1


def test_the_patched_names_are_verl_0_9_1s() -> None:
    """The stand-in takes the vLLM server's place by name: the classes, methods and weight-version
    attributes that hops.py patches are there in verl's own source (parsed: they import vLLM,
    SGLang and TensorRT-LLM)."""
    import verl

    from otel_tracking.verl.hops import CALLEES

    root = Path(verl.__file__).parent.parent
    for module, targets in CALLEES.items():
        tree = ast.parse((root / (module.replace(".", "/") + ".py")).read_text())
        classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        for class_name, method_name, version in targets:
            methods = {n.name: n for n in classes[class_name].body if isinstance(n, ast.AsyncFunctionDef)}
            assert method_name in methods, (module, class_name, method_name)
            if version is not None:
                assigned = {
                    t.attr
                    for n in ast.walk(classes[class_name])
                    if isinstance(n, ast.Assign)
                    for t in n.targets
                    if isinstance(t, ast.Attribute)
                }
                assert version in assigned, (module, class_name, version)
