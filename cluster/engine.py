"""Engine: the synchronous core of the central actor (used by ``LLM`` and by ``AsyncEngine``).

One ``step()`` = schedule -> build the StepPlan -> ``executor.execute`` -> apply the sampled tokens
-> stream RequestOutput deltas. The engine is single-threaded: callers serialize access (AsyncEngine
applies intake and aborts between steps on its step thread).

Decisions:
- ``max_model_len`` = min(config value or the model's max_position_embeddings, KV capacity minus
  the watermark), so that a lone sequence always fits and preemption always makes progress.
- An executor failure ends every in-flight request with finish_reason "error" (their outputs are
  returned by that ``step()``), frees their blocks and marks the engine dead: later calls raise
  EngineDeadError. Nothing hangs.
- ``abort`` frees the request's blocks at once; its final output (finish_reason "abort") is
  returned by the next ``step()``.
- When sequences were released and nothing else is scheduled, a plan with only
  ``released_seq_ids`` is still sent so that worker mirrors never outlive their sequences.
"""

from __future__ import annotations

import functools

from pagedray.block_manager import BlockManager

from .config import EngineConfig
from .executor import Executor, create_executor
from .output_builder import OutputBuilder
from .outputs import EngineDeadError, RequestOutput
from .plan_builder import PlanBuilder
from .request import FinishReason
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .stats import EngineStats


class Engine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        from pagedray.workers.default_model import resolve_model_path
        from pagedray.workers.model_info import model_info

        self.config = config
        self.model_path = resolve_model_path(config.model.model)
        self.model_info = model_info(self.model_path)
        self.executor = executor if executor is not None else create_executor(config)
        cache = config.cache
        self.block_manager = BlockManager(cache.block_size, self.executor.num_blocks,
                                          enable_prefix_caching=cache.enable_prefix_caching,
                                          watermark=cache.watermark)
        self.max_model_len = self._effective_max_model_len()
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   eos_token_ids=frozenset(self.model_info.eos_token_ids))
        self.plan_builder = PlanBuilder(self.block_manager)
        self.output_builder = OutputBuilder()
        self._pending: list[RequestOutput] = []
        self._dead: BaseException | None = None
        self._num_steps = 0
        self._num_finished = 0

    def _effective_max_model_len(self) -> int:
        limit = self.config.model.max_model_len or self.model_info.max_position_embeddings
        bm = self.block_manager
        capacity = (bm.num_blocks - bm.watermark_blocks) * bm.block_size
        return max(2, min(limit, capacity))

    @functools.cached_property
    def tokenizer(self):
        """The Hugging Face tokenizer (loaded on first use; token-id-only callers never load it)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.config.model.tokenizer or str(self.model_path))

    # -- intake -------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Argument-only checks (safe from any thread): ValueError, or EngineDeadError when dead."""
        self._raise_if_dead()
        self.scheduler.validate_request(prompt_token_ids, params, priority)
        vocab = self.model_info.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token {bad!r} is not an id in [0, {vocab})")

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      priority: int = 0) -> None:
        """Raises ValueError / QueueFullError / EngineDeadError for a request add_request would refuse."""
        self.validate_request(prompt_token_ids, params, priority)
        self.scheduler.check_request(request_id, prompt_token_ids, params, priority)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        self.check_request(request_id, prompt_token_ids, params, priority)
        self.scheduler.add_request(request_id, list(prompt_token_ids), params, priority)

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.abort(request_id, FinishReason.ABORT)
        if request is None:
            return False
        self._num_finished += 1
        self._pending.append(self.output_builder.make(request))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or (
            self._dead is None and self.scheduler.has_pending_releases)

    # -- stepping -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._dead is not None:
            return outputs
        out = self.scheduler.schedule()
        plan = self.plan_builder.build(out)
        if not plan.new_seqs and not plan.running and not plan.released_seq_ids:
            return outputs
        self._num_steps += 1
        try:
            result = self.executor.execute(plan)
            if result.step_id != plan.step_id:
                raise RuntimeError(f"executor answered step {result.step_id} for plan {plan.step_id}")
            touched = self.scheduler.update(out, result.sampled)
        except Exception as exc:  # any executor failure ends the in-flight requests
            return outputs + self._fail(exc)
        for request in touched:
            if request.is_finished:
                self._num_finished += 1
            outputs.append(self.output_builder.make(request))
        return outputs

    def _fail(self, exc: BaseException) -> list[RequestOutput]:
        self._dead = exc
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        failed = self.scheduler.abort_all(FinishReason.ERROR)
        self.plan_builder.forget_all()
        self._num_finished += len(failed)
        return [self.output_builder.make(r, error=message) for r in failed]

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {type(self._dead).__name__}: {self._dead}")

    def check_health(self) -> None:
        self._raise_if_dead()
        self.executor.check_health()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    # -- stats / shutdown -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm_stats = self.block_manager.stats()
        sched = self.scheduler
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_blocks=bm_stats.num_blocks,
            num_free_blocks=bm_stats.num_free_blocks,
            kv_usage=bm_stats.usage,
            prefix_hit_rate=bm_stats.prefix_hit_rate,
            prefix_query_tokens_total=bm_stats.prefix_query_tokens,
            prefix_hit_tokens_total=bm_stats.prefix_hit_tokens,
            num_preemptions_total=sched.num_preemptions,
            num_prompt_tokens_total=sched.num_prompt_tokens,
            num_generation_tokens_total=sched.num_generated_tokens,
            num_computed_tokens_total=sched.num_computed_tokens,
            num_steps_total=self._num_steps,
            num_requests_finished_total=self._num_finished,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
