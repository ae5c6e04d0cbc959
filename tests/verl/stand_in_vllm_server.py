"""Stands in for verl's ``verl/workers/rollout/vllm_rollout/vllm_async_server.py`` (which imports
vLLM, and vLLM needs a GPU): copied over that file in a copy of verl 0.9.1 that the agent-loop
test puts first on ``PYTHONPATH``, so that ``otel_tracking.verl`` instruments it by verl's own
module and class names.  Only the inference engine is missing: ``generate`` is shaped as verl's
``vLLMHttpServer.generate`` (its parameters, verl's ``RLInsightLogger.trace_state("vllm_generate",
lane replica_<n>)`` around the engine call, ``global_steps`` in the output) and
``set_global_steps`` is verl's, but the "engine" doubles each prompt token."""

from __future__ import annotations

import asyncio
from typing import Any

from verl.utils.tracking import RLInsightLogger
from verl.workers.rollout.replica import TokenOutput


class vLLMHttpServer:
    def __init__(self, replica_rank: int) -> None:
        self.replica_rank = replica_rank
        self.global_steps = None  # model weights version, set by ServerAdapter when update weights

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        kv_transfer_params: dict | None = None,
    ) -> TokenOutput:
        with RLInsightLogger.trace_state("vllm_generate", state_lane_id=f"replica_{self.replica_rank}"):
            await asyncio.sleep(0)  # the engine
            token_ids = [2 * token for token in prompt_ids]
        return TokenOutput(token_ids=token_ids, log_probs=None, extra_fields={"global_steps": self.global_steps})

    async def set_global_steps(self, global_steps: int) -> None:
        """Set the global steps of the model weights."""
        self.global_steps = global_steps
