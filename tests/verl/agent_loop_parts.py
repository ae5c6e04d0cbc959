"""verl's agent loop on CPU: its real ``AgentLoopManager``, ``AgentLoopWorker`` (as a Ray actor),
``LLMServerClient`` and ``GlobalRequestLoadBalancer``, in front of the stand-in vLLM servers
(``stand_in_vllm_server.py``).

What is not verl's here, as in verl's own CPU tests of the agent loop
(``tests/experimental/agent_loop/test_agent_loop_extra_fields_schema_on_cpu.py``): the worker's
``__init__`` (verl's loads a Hugging Face model config and tokenizer), its two post-processing steps
(tokenizer padding), and the agent loop itself (a registered one that sends the prompt to the
server through the real ``LLMServerClient``, timed by ``simple_timer`` as verl's single-turn loop
is).  ``AgentLoopWorker.generate_sequences`` and ``_run_agent_loop``, which fan the batch out into
asyncio tasks, are verl's."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

import numpy as np
import ray
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker, register
from verl.utils.profiler import simple_timer
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.router import get_router_handle
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

PROMPT_LENGTH = 2


def config(num_workers: int) -> Any:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "name": "vllm",
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "top_k": -1,
                    "calculate_log_probs": False,
                    "agent": {"num_workers": num_workers, "default_agent_loop": "otel_echo_agent"},
                },
                "model": {},
            },
            "data": {},
        }
    )


@register("otel_echo_agent")
class EchoAgentLoop:
    def __init__(self, server_manager: LLMServerClient, **kwargs: Any) -> None:
        self.server_manager = server_manager

    async def run(self, sampling_params: dict[str, Any], raw_prompt_ids: Any, **kwargs: Any) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        prompt_ids = [int(token) for token in raw_prompt_ids]
        with simple_timer("generate_sequences", metrics):
            output = await self.server_manager.generate(
                request_id=uuid4().hex, prompt_ids=prompt_ids, sampling_params=sampling_params
            )
        return {"prompt_ids": prompt_ids, "output": output, "metrics": metrics}


class CpuAgentLoopWorker(AgentLoopWorker):
    def __init__(self, config: Any, llm_client: LLMServerClient, teacher_client: Any = None, reward: Any = None):
        self.config = config
        self.llm_client = llm_client
        self.rollout_config = config.actor_rollout_ref.rollout
        self.tokenizer = None
        self.processor = None
        self.hf_model_type = None
        self.dataset_cls = None
        self.tools: list[Any] = []

    async def _agent_loop_postprocess(self, output: Any, validate: Any, **kwargs: Any) -> Any:
        return output

    def _postprocess(self, inputs: list[Any], input_non_tensor_batch: Any = None, validate: Any = False) -> DataProto:
        responses = [sample["output"].token_ids for sample in inputs]
        batch = TensorDict(
            {
                "prompts": torch.tensor([sample["prompt_ids"] for sample in inputs]),
                "responses": torch.tensor(responses),
            },
            batch_size=[len(inputs)],
        )
        versions = np.array([sample["output"].extra_fields.get("global_steps") for sample in inputs], dtype=object)
        metrics = [
            {
                "generate_sequences": sample["metrics"]["generate_sequences"],
                "tool_calls": 0.0,
                "compute_score": 0.0,
                "num_preempted": 0,
            }
            for sample in inputs
        ]
        return DataProto(batch=batch, non_tensor_batch={"weight_version": versions}, meta_info={"metrics": metrics})


class CpuAgentLoopManager(AgentLoopManager):
    agent_loop_workers_class = ray.remote(CpuAgentLoopWorker)


def build(num_workers: int = 2, num_servers: int = 2) -> tuple[AgentLoopManager, list[Any]]:
    """The manager (its workers started) and the servers, as ``LLMServerManager`` wires them."""
    servers = [ray.remote(vLLMHttpServer).remote(replica_rank=rank) for rank in range(num_servers)]
    balancer = get_router_handle(servers={f"127.0.0.1:{8000 + i}": s for i, s in enumerate(servers)})
    cfg = config(num_workers)
    client = LLMServerClient(cfg, load_balancer_handle=balancer)
    return CpuAgentLoopManager.create(cfg, client), servers


def prompts(step: int, n: int = 4) -> DataProto:
    ids = np.empty(n, dtype=object)
    ids[:] = [[step, i] for i in range(n)]
    batch = TensorDict({"dummy": torch.zeros(n, 1)}, batch_size=[n])
    return DataProto(batch=batch, non_tensor_batch={"raw_prompt_ids": ids}, meta_info={"global_steps": step})
