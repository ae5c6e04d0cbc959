"""A run on a real local Ray cluster: the driver's step traces continue into actors.

The test process is the driver (``Tracking`` with OTLP to a real endpoint); actors get the OTLP
settings and the run identity through ``runtime_env()``, and the caller's context through
``with_context(...)`` into ``@traced`` methods: sync, async (concurrent calls on lanes),
generator and async generator, plus a remote function and another actor called from inside an
actor (a process other than the one that created the callee).  Every actor seeds ``random`` alike.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from otel_tracking import Tracking, trace_state
from otel_tracking.distributed.ray_tracing import CARRIER_KWARG, runtime_env, traced, with_context
from otel_tracking.distributed.worker import configure_worker
from tests.otlp_receiver import HttpReceiver, wait_for

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # Workers import this module (and otel_tracking) by reference: give them the repository.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote
@traced
def score(sample: int) -> int:
    with trace_state("reward_fn", state_lane_id="reward"):
        return sample * 2


@ray.remote
@traced
class ActorWorker:
    def __init__(self, rank: int) -> None:
        random.seed(0)
        self.rank = rank

    def update_actor(self, batch: int) -> int:
        with trace_state("update_actor", state_lane_id=f"rank_{self.rank}"):
            # a remote function called from this actor: the context goes one hop further
            return ray.get(with_context(score).remote(batch))

    def relay(self, server: Any, request: int) -> int:
        """Calls another actor it did not create: the context goes along from this process."""
        with trace_state("relay", state_lane_id=f"rank_{self.rank}"):
            return ray.get(with_context(server).generate.remote(request))

    def pid(self) -> int:
        return os.getpid()


@ray.remote
@traced
class RolloutServer:
    def __init__(self, replica: int) -> None:
        random.seed(0)
        self.replica = replica

    async def generate(self, request: int) -> int:
        with trace_state("vllm_generate", state_lane_id=f"replica_{self.replica}", request=request):
            await asyncio.sleep(0.01)  # concurrent requests interleave on the lane
            return request

    def stream(self, n: int) -> Iterator[int]:
        for i in range(n):
            with trace_state("stream_chunk", state_lane_id=f"replica_{self.replica}"):
                yield i

    async def astream(self, n: int) -> Any:
        for i in range(n):
            with trace_state("astream_chunk", state_lane_id=f"replica_{self.replica}"):
                yield i

    def pid(self) -> int:
        return os.getpid()


@ray.remote
@traced
class Ranked:
    def __init__(self, rank: int, configured: int | None = None) -> None:
        self.rank = rank
        if configured is not None:
            configure_worker(rank=configured)

    def work(self) -> int:
        with trace_state("ranked_work"):
            return os.getpid()


def test_worker_rank_from_configure_worker_then_rank_then_the_actors_attribute(
    cluster: None, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        env = runtime_env()
        with_rank_variable = runtime_env({"env_vars": {"RANK": "4"}})
        actors = {
            "attribute": Ranked.options(runtime_env=env).remote(1),
            "configured": Ranked.options(runtime_env=with_rank_variable).remote(1, configured=9),
            "variable": Ranked.options(runtime_env=with_rank_variable).remote(1),
        }
        pids = {name: ray.get(actor.work.remote()) for name, actor in actors.items()}
        # the call returned after its span left the actor: it is at the endpoint now
        ranks = {s["resource"]["process.pid"]: s["resource"].get("ml.rank") for s in receiver.received.spans()}
    assert {name: ranks.get(pid) for name, pid in pids.items()} == {"attribute": 1, "configured": 9, "variable": 4}


def test_traced_signature_names_the_carrier_and_keeps_the_kind() -> None:
    def plain(self: Any, batch: int, *rest: int, flag: bool = False, **options: Any) -> None: ...

    async def coroutine(self: Any) -> None: ...

    def generator(self: Any) -> Iterator[int]:
        yield 1

    async def async_generator(self: Any) -> Any:
        yield 1

    wrapped = traced(plain)
    assert inspect.unwrap(wrapped) is wrapped  # Ray unwraps before it reads signatures
    assert str(inspect.signature(wrapped)) == (
        "(self: 'Any', batch: 'int', *rest: 'int', flag: 'bool' = False, _otel_context=None, "
        "**options: 'Any') -> 'None'"
    )
    assert inspect.iscoroutinefunction(traced(coroutine))
    assert inspect.isgeneratorfunction(traced(generator))
    assert inspect.isasyncgenfunction(traced(async_generator))
    assert traced(wrapped) is wrapped
    assert CARRIER_KWARG == "_otel_context"


def test_driver_step_traces_continue_into_ray_actors(
    cluster: None, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20secret-token")
        tracking = Tracking("proj", "exp", default_backend="file")
        env = runtime_env()
        assert "OTEL_EXPORTER_OTLP_HEADERS" not in env["env_vars"], "credentials only when asked"
        actors = [ActorWorker.options(runtime_env=env).remote(rank) for rank in (0, 1)]
        server = RolloutServer.options(runtime_env=env, max_concurrency=8).remote(0)
        pids = {"actor": ray.get([a.pid.remote() for a in actors]), "rollout": ray.get(server.pid.remote())}

        for step in (1, 2):
            with trace_state("generate_sequences"):
                outputs = ray.get([with_context(server).generate.remote(r) for r in range(4)])
                assert outputs == [0, 1, 2, 3]
                assert ray.get(list(with_context(server).stream.options(num_returns="streaming").remote(2))) == [0, 1]
                chunks = with_context(server).astream.options(num_returns="streaming").remote(2)
                assert ray.get(list(chunks)) == [0, 1]
            assert ray.get(with_context(actors[1]).relay.remote(server, 100 + step)) == 100 + step
            # Outside any span: the workers' phases hang directly under the step's root span.
            assert ray.get([with_context(a).update_actor.remote(step) for a in actors]) == [2 * step, 2 * step]
            tracking.log({"loss": 1.0 / step}, step)
        # An old-style call without a context still works (a root span in the worker).
        assert ray.get(actors[0].update_actor.remote(0)) == 0
        tracking.finish()

        expected = {
            "vllm_generate": 10,
            "stream_chunk": 4,
            "astream_chunk": 4,
            "update_actor": 5,
            "reward_fn": 5,
            "relay": 2,
        }

        def arrived() -> list[dict[str, Any]] | None:
            spans = receiver.received.spans()
            counts = {name: sum(s["name"] == name for s in spans) for name in expected}
            return spans if counts == expected and any(s["name"] == "ml.step" for s in spans) else None

        spans = wait_for(arrived, timeout_s=90, what=f"spans {expected}")

    by_id = {s["span_id"]: s for s in spans}
    assert len(by_id) == len(spans), "seeded alike, every span id is distinct"
    roots = {s["trace_id"]: s for s in spans if s["name"] == "ml.step"}
    assert sorted(r["attributes"]["ml.step"] for r in roots.values()) == [1, 2]
    contextless = [s for s in spans if s["name"] == "update_actor" and s["parent_span_id"] is None]
    assert len(contextless) == 1, "the call without a context is a root span of its own trace"
    for span in spans:
        resource = span["resource"]
        assert resource["ml.run.id"] == tracking.run_id, span
        assert "secret-token" not in repr(span)
        if span["trace_id"] == contextless[0]["trace_id"]:
            assert span["name"] in ("update_actor", "reward_fn")
            continue
        root = roots[span["trace_id"]]  # every other span belongs to one step's trace
        if span["name"] in ("ml.step", "generate_sequences"):
            assert resource["process.pid"] == os.getpid()
            continue
        parent = by_id[span["parent_span_id"]]
        if span["name"] == "relay":  # called outside any driver span: under the step's root
            assert parent is root and resource["process.pid"] == pids["actor"][1]
        elif span["name"] == "vllm_generate" and parent["name"] == "relay":  # one actor calling another
            assert parent["resource"]["process.pid"] == pids["actor"][1]
            assert resource["process.pid"] == pids["rollout"]
        elif span["name"] in ("vllm_generate", "stream_chunk", "astream_chunk"):
            assert parent["name"] == "generate_sequences"
            assert resource["process.pid"] == pids["rollout"] and resource["ml.role"] == "RolloutServer"
            assert span["attributes"]["ml.lane"] == "replica_0"
            assert "ml.rank" not in resource, "an actor without a rank attribute has none"
        elif span["name"] == "update_actor":
            # Called outside any span on the driver: directly under the step's root span.
            assert parent is root
            assert resource["process.pid"] in pids["actor"] and resource["ml.role"] == "ActorWorker"
            rank = pids["actor"].index(resource["process.pid"])
            assert span["attributes"]["ml.lane"] == f"rank_{rank}"
            assert resource["ml.rank"] == rank, "ml.rank: the actor's rank attribute"
        else:
            assert span["name"] == "reward_fn" and parent["name"] == "update_actor"
            assert resource["process.pid"] != os.getpid()  # a Ray task worker
            assert "ml.rank" not in resource
        # The step in progress travels in the baggage: unknown before the first log() (the root says
        # it), then last + 1.
        assert span["attributes"].get("ml.step") == {1: None, 2: 2}[root["attributes"]["ml.step"]]
    # Concurrent requests on one lane do not nest under each other.
    generate = [s for s in spans if s["name"] == "vllm_generate"]
    assert sorted(by_id[s["parent_span_id"]]["name"] for s in generate) == ["generate_sequences"] * 8 + ["relay"] * 2
