"""Engine: the synchronous core of the central actor (used by ``LLM`` and by ``AsyncEngine``).

One ``step()`` = schedule -> build the StepPlan -> ``executor.execute`` -> apply the sampled tokens
-> stream RequestOutput deltas. The engine is single-threaded: callers serialize access (AsyncEngine
applies intake and aborts between steps on its step thread).

Decisions: docs/design/cluster.md, ``pagedray.cluster.engine``.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from dataclasses import dataclass, replace

from pagedray.block_manager import BlockManager
from pagedray.workers.contract.config import EngineConfig
from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import StepPlan, StepResult
from pagedray.workers.lora.model_lora import module_shapes
from pagedray.workers.models.model_info import load_hf_config, model_info
from pagedray.workers.weights.default_model import resolve_model_path

from .executor import Executor, create_executor
from .hybrid import settle_hybrid_config
from .kv_transfers import KVExport, KVLayout, KVTransfers, Transfer
from .lora_slots import AdapterSlots, LoraRegistry
from .output_builder import OutputBuilder
from .outputs import EngineDeadError, RequestOutput
from .plan_builder import PlanBuilder
from .request import FinishReason
from .scheduler import Scheduler, check_arguments
from .scheduler_output import SchedulerOutput
from .stats import EngineStats
from .tier_cost import TierCost

logger = logging.getLogger(__name__)
# what callers (and so HTTP clients) are told; the failure itself goes to the log, never to a client
MAX_SESSION_CHARS = 256   # a session id (prompt_cache_key, X-Session-Id)
ENGINE_DEAD_MESSAGE = "engine dead: a step failed (the server log has the details)"


@dataclass(frozen=True)
class _InFlight:
    """Async scheduling: a submitted step whose result is not applied yet."""

    out: SchedulerOutput
    plan: StepPlan
    handle: object


class Engine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.step_limit_s = config.step_limit_s(0)   # the running (or last) step's time limit
        self.model_path = resolve_model_path(config.model.model)
        self.model_info = model_info(self.model_path)
        if self.model_info.hybrid:
            self.config = config = settle_hybrid_config(config, self.model_info.architecture)
        self.executor = executor if executor is not None else create_executor(config)
        self.dtype = self.executor.dtype      # what dtype "auto" became on the ranks (dtype_choice.py)
        self.block_manager = self._new_block_manager(self.executor.num_blocks)
        self.max_model_len = self._effective_max_model_len()
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   eos_token_ids=frozenset(self.model_info.eos_token_ids))
        self.lora_registry: LoraRegistry | None = None    # enable_lora: the adapters requests may name
        if config.model.enable_lora:
            shapes = module_shapes(load_hf_config(self.model_path), self.max_model_len)
            self.lora_registry = LoraRegistry(shapes, config.model.max_lora_rank, config.model.lora_module_paths())
            self.scheduler.lora_slots = AdapterSlots(config.model.max_loras, config.model.max_cpu_loras)
        self.plan_builder = self._plan_builder()
        self.output_builder = OutputBuilder()
        self._pending: list[RequestOutput] = []
        self._dead: BaseException | None = None
        self._num_steps = 0
        self._num_finished = 0
        self._warm_up_ids: set[str] = set()     # internal requests re-prefilling hot prefixes (_queue_warm_up)
        self.num_rank_restarts = 0
        self.recovering = False                 # True while the TP group is being rebuilt (step thread)
        self.last_recovery_s: float | None = None   # duration of the last rebuild + reset
        self._prefix_totals_before = (0, 0)     # prefix query/hit tokens of BlockManagers replaced by recovery
        self._async_scheduling = config.scheduler.async_scheduling
        self._in_flight: _InFlight | None = None   # async scheduling: the submitted step not applied yet
        self.tier_cost = TierCost(config.cache.block_size)   # a computed token's cost, a second-tier block's worth
        self.transfers = KVTransfers(self.kv_layout())       # blocks moving to and from other replicas
        self._last_transfer_only = False                     # the last plan carried transfers and nothing else

    def _plan_builder(self) -> PlanBuilder:
        # speculative steps keep one RunningDelta per sequence (the rows of their batch stay in scheduling order)
        return PlanBuilder(self.block_manager, plain_decodes=not self.config.scheduler.num_speculative_tokens)

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
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                 resume_tokens: list[int] = (), lora: LoRARequest | None = None, session: str | None = None,
                 tenant: str | None = None) -> None:
        """A request's argument checks (safe from any thread, no queue state): ValueError naming the argument,
        or EngineDeadError when dead. ``lora``: its adapter, checked once per (name, path) from its files;
        ``session``: its session (``block_manager/session_pins.py``), a string of 1-256 characters; ``tenant``:
        a tenant of ``SchedulerConfig.tenants`` (None: the default tenant; cluster/fair_share.py)."""
        self._raise_if_dead()
        if tenant is not None and (not isinstance(tenant, str) or self.config.scheduler.tenant(tenant) is None):
            names = [t.name for t in self.config.scheduler.tenants]
            raise ValueError(f"tenant: {tenant!r:.80} is not a configured tenant (tenants: {names})")
        if session is not None and (not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS):
            raise ValueError(f"session: must be a string of 1-{MAX_SESSION_CHARS} characters, got {session!r:.80}")
        if lora is not None:
            if self.lora_registry is None:
                raise ValueError("lora_request: this engine serves no LoRA adapters (start it with enable_lora)")
            if not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request: must be a LoRARequest, got {type(lora).__name__}")
            self.lora_registry.check(lora)
        check_arguments(prompt_token_ids, params, priority, resume_tokens, self.max_model_len,
                        self.config.scheduler.max_num_seqs)
        vocab = self.model_info.vocab_size
        for name, ids in (("prompt_token_ids", prompt_token_ids), ("resume_tokens", resume_tokens)):
            bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token {bad!r} is not an id in [0, {vocab})")
        biased = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if biased is not None:
            raise ValueError(f"logit_bias: token {biased} is not an id in [0, {vocab})")
        scored = next((t for t in params.pooling_token_ids if t >= vocab), None)
        if scored is not None:
            raise ValueError(f"pooling_token_ids: token {scored} is not an id in [0, {vocab})")
        if params.pooling is not None and resume_tokens:
            raise ValueError("resume_tokens: a pooling request has no output to resume")

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
            resume_tokens: list[int] = (), *, validated: bool = False, lora: LoRARequest | None = None,
            session: str | None = None, tenant: str | None = None) -> None:
        """Admits a request: ``validate`` (unless ``validated``: the AsyncEngine and ``LLM`` validate at
        intake, so each request is validated once), the admission checks (a live engine, the id, the queue),
        then the enqueue; a refused request raises and changes nothing. ``params`` is immutable and the
        prompt a private copy, so what was validated is what runs. ``resume_tokens`` (n=1 only): the output
        a run elsewhere already produced (a stream's continuation after its replica was lost): the sequence
        starts with them as output, computed with the prompt and not streamed again, so sampling goes on at
        the next position as that run would have (greedy and seeded draws depend on the position, penalties
        see them)."""
        if not validated:
            self.validate(prompt_token_ids, params, priority, resume_tokens, lora, session, tenant)
        self._raise_if_dead()
        self.scheduler.check_admission(request_id, tenant, len(prompt_token_ids) + len(resume_tokens))
        self.scheduler.enqueue(request_id, list(prompt_token_ids), params, priority, resume_tokens, lora, session,
                               tenant)

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.abort(request_id, FinishReason.ABORT)
        if request is None:
            return False
        self._num_finished += 1
        self._pending.append(self.output_builder.make(request))
        return True

    def has_unfinished_requests(self) -> bool:
        """Work for another ``step``: requests, outputs to hand out, or finished sequences to release."""
        return self.has_requests() or (self._dead is None and self.scheduler.has_pending_releases)

    def has_requests(self) -> bool:
        """Requests running or waiting, a step in flight, or outputs not handed out yet; unlike
        ``has_unfinished_requests``, finished sequences whose release the ranks still await do not count."""
        return (self.scheduler.has_unfinished() or bool(self._pending) or self._in_flight is not None
                or self.transfers.has_work)

    # -- stepping -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._dead is not None:
            return outputs
        transfer_only = self.transfers.has_unsent and not self._last_transfer_only   # every other step at most
        self._last_transfer_only = transfer_only
        out = self.scheduler.transfer_output() if transfer_only else self.scheduler.schedule()
        plan = self.plan_builder.build(out)
        self.transfers.fill(plan)
        has_work = bool(plan.decodes or plan.new_seqs or plan.running or plan.released_seq_ids or plan.lora_reads
                        or plan.lora_drops or self._lora_reads_in_flight or plan.kv_saves or plan.kv_loads
                        or plan.kv_exports or plan.kv_imports)
        if self._async_scheduling:
            return outputs + self._step_ahead(out, plan, has_work)
        if not has_work:
            return outputs
        self._num_steps += 1
        self.step_limit_s = self.config.step_limit_s(plan.num_scheduled_tokens)
        try:
            started = time.perf_counter()
            result = self.executor.execute(plan)
            if not (plan.kv_exports or plan.kv_imports):   # a transfer's bytes are no compute
                self.tier_cost.observe(plan.num_scheduled_tokens, time.perf_counter() - started, len(plan.kv_loads),
                                       result.kv_load_seconds)
            touched = self._apply(out, plan, result)
        except Exception as exc:  # a curable rank failure is recovered from; any other ends the requests
            failure = self._recover(exc)
            return outputs if failure is None else outputs + self._fail(failure)
        return outputs + self._outputs_of(touched)

    @property
    def _lora_reads_in_flight(self) -> bool:
        """Adapter reads the ranks have not reported finished: a step with nothing else to run still goes out,
        so that rank 0 can report them (it waits for one a moment first: ``Worker``)."""
        slots = self.scheduler.lora_slots
        return slots is not None and slots.reads_in_flight

    def _step_ahead(self, out, plan: StepPlan, has_work: bool) -> list[RequestOutput]:
        """Async scheduling: submit this plan behind the one in flight, then wait for that one and apply it."""
        previous, self._in_flight = self._in_flight, None
        if previous is None and not has_work:
            return []
        tokens = plan.num_scheduled_tokens + (previous.plan.num_scheduled_tokens if previous else 0)
        self.step_limit_s = self.config.step_limit_s(tokens)
        unsettled = previous          # submitted and not waited for yet
        try:
            if has_work:
                self._num_steps += 1
                self._in_flight = _InFlight(out, plan, self.executor.submit(plan))
            if previous is None:
                return []
            unsettled = None          # wait() settles it, also when it raises
            touched = self._apply(previous.out, previous.plan, self.executor.wait(previous.handle))
        except Exception as exc:
            self._settle(unsettled)
            self._settle(self._in_flight)
            self._in_flight = None
            failure = self._recover(exc)
            return [] if failure is None else self._fail(failure)
        return self._outputs_of(touched)

    def _apply(self, out, plan: StepPlan, result: StepResult) -> list:
        if result.step_id != plan.step_id:
            raise RuntimeError(f"executor answered step {result.step_id} for plan {plan.step_id}")
        touched = self.scheduler.update(out, result.sampled, result.prompt_logprobs, result.pooled)
        if plan.kv_loads:
            self.block_manager.finish_loads(plan.kv_loads, result.kv_load_failures)
        if plan.kv_exports or plan.kv_imports:
            self.transfers.finish(self.block_manager, plan, result)
        return touched + self.scheduler.apply_lora_reads(result.lora_reads) if result.lora_reads else touched

    def _outputs_of(self, touched: list) -> list[RequestOutput]:
        outputs, warm_up, make = [], self._warm_up_ids, self.output_builder.make
        for request in touched:
            if warm_up and request.request_id in warm_up:   # internal: nobody waits for its output
                if request.is_finished:
                    warm_up.discard(request.request_id)
                continue
            output = make(request)
            self._num_finished += output.finished
            outputs.append(output)
        return outputs

    def _settle(self, step: _InFlight | None) -> None:
        """Waits for a step submitted next to a failed one and ignores its result (or its failure)."""
        if step is not None:
            try:
                self.executor.wait(step.handle)
            except Exception:  # noqa: BLE001 - the failure that matters is the failed step's
                pass

    def set_async_scheduling(self, on: bool) -> None:
        """Switches async scheduling between steps (benchmarks compare both modes on one loaded
        engine); ValueError while a step is in flight or when the config cannot schedule ahead (TP > 1)."""
        if not isinstance(on, bool):
            raise ValueError(f"on: must be true or false, got {on!r}")
        if self._in_flight is not None:
            raise ValueError("on: a step is in flight; switch between generate calls")
        if on and self.config.parallel.tensor_parallel_size != 1:
            raise ValueError("on: async_scheduling needs tensor_parallel_size 1")
        self._async_scheduling = on

    def _recover(self, exc: Exception) -> Exception | None:
        """Rebuilds the TP group after a rank failure; returns None when recovered, else the failure."""
        self.transfers.fail_all(self.block_manager, exc)
        if not self.executor.is_rank_failure(exc):
            return exc
        limit = self.config.parallel.max_rank_restarts
        if self.num_rank_restarts >= limit:
            return RuntimeError(f"{exc} (max_rank_restarts={limit} rebuilds already used)")
        self.num_rank_restarts += 1
        started = time.monotonic()
        hot = self.block_manager.hot_prefixes(self.config.cache.warm_prefix_tokens)   # the lost cache's
        requeued = self.scheduler.reset_after_kv_loss(self._fresh_block_manager())
        self.block_manager = self.scheduler.block_manager
        self.plan_builder = self._plan_builder()
        logger.warning("TP rank failure (%s); rebuilding the TP group, %d running sequences re-queued",
                       exc, len(requeued))
        self.recovering = True
        try:
            self.executor.rebuild()
        except Exception as rebuild_exc:
            return RuntimeError(f"{exc}; rebuilding the TP group failed: {type(rebuild_exc).__name__}: {rebuild_exc}")
        finally:
            self.recovering = False
        self.last_recovery_s = time.monotonic() - started
        logger.warning("TP group rebuilt in %.2f s", self.last_recovery_s)
        self._queue_warm_up(hot)
        return None

    def _queue_warm_up(self, prefixes: list[list[int]]) -> None:
        """Internal requests that prefill ``prefixes`` again (one token each, never streamed), queued after the
        re-queued sequences: the requests after a rebuild find the prefixes they kept reusing cached."""
        params = SamplingParams(max_tokens=1, temperature=0)
        for tokens in prefixes:
            if len(tokens) < self.max_model_len:
                request_id = f"pagedray-warm-up-{uuid.uuid4().hex}"
                self.scheduler.enqueue(request_id, tokens, params)
                self._warm_up_ids.add(request_id)

    # -- moving KV blocks between replicas (kv_transfers.py) ------------------------------------------
    def kv_layout(self) -> KVLayout:
        info, cache = self.model_info, self.config.cache
        return KVLayout(self.config.model.model, info.architecture, info.num_hidden_layers, info.num_attention_heads,
                        info.num_key_value_heads, info.head_dim, cache.block_size, self.dtype, cache.kv_cache_dtype,
                        self.config.parallel.tensor_parallel_size, info.kv_layer_shapes)

    def start_export(self, token_ids: list[int], lora: LoRARequest | None = None) -> Transfer:
        """Starts exporting the longest cached run of full blocks of ``token_ids`` (under ``lora``'s chains);
        the Transfer's result is a KVExport once the next steps read them (no cached block: an empty one)."""
        self._check_transfers("export")
        if not isinstance(token_ids, (list, tuple)) or not all(type(t) is int for t in token_ids):  # noqa: E721
            raise ValueError("token_ids: must be a list of integers")
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest, got {type(lora).__name__}")
        return self.transfers.start_export(self.block_manager, list(token_ids),
                                           None if lora is None else lora.cache_namespace)

    def start_import(self, export: KVExport) -> Transfer:
        """Starts importing ``export`` into the prefix cache (ValueError naming what does not match, nothing
        changed); the Transfer's result is how many of its tokens are cached here once the next steps wrote them."""
        self._check_transfers("import")
        return self.transfers.start_import(self.block_manager, export)

    def start_request_export(self, request_id: str, sample: int = 0) -> Transfer:
        """An export of the blocks of a running request's sample ``sample`` (its prompt and that sample's output so
        far: what its continuation on another replica would compute again; a sample not forked yet: the prompt's);
        a Transfer settled with None when the request is not here, the sample is finished, or this engine cannot
        export."""
        request = self.scheduler.requests.get(request_id)
        if request is not None and request.sequences and 0 <= sample < request.params.n:
            seq = next((s for s in request.sequences if s.index == sample), None)
            tokens = request.prompt_token_ids if seq is None else seq.token_ids
            if seq is None or not seq.is_finished:
                try:
                    return self.start_export(list(tokens), request.lora)
                except ValueError:
                    pass
        transfer = Transfer()
        transfer.settle(None)
        return transfer

    def export_prefix(self, token_ids: list[int], lora: LoRARequest | None = None) -> KVExport:
        """``start_export``, stepping until it is done (other requests' outputs wait for the next ``step``)."""
        return self._run_transfer(self.start_export(token_ids, lora))

    def import_prefix(self, export: KVExport) -> int:
        """``start_import``, stepping until it is done: the tokens of ``export`` now cached here."""
        return self._run_transfer(self.start_import(export))

    def _check_transfers(self, what: str) -> None:
        self._raise_if_dead()
        if not self.config.cache.enable_prefix_caching:
            raise ValueError(f"{what}: blocks move between prefix caches, and enable_prefix_caching is off")
        if self.config.scheduler.speculative_model is not None:
            raise ValueError(f"{what}: not with speculative_model (the draft model's cache does not move)")
        if self.model_info.hybrid:
            raise ValueError(f"{what}: not for {self.model_info.architecture} (its recurrent states do not move "
                             "with the KV blocks: cluster/hybrid.py)")

    def _run_transfer(self, transfer: Transfer):
        while not transfer.done and self._dead is None:
            self._pending = self.step()
        if transfer.error is not None:
            raise transfer.error
        self._raise_if_dead()
        return transfer.result

    def _fresh_block_manager(self) -> BlockManager:
        old = self.block_manager
        stats = old.stats()
        query, hit = self._prefix_totals_before
        self._prefix_totals_before = (query + stats.prefix_query_tokens, hit + stats.prefix_hit_tokens)
        return self._new_block_manager(old.num_blocks)

    def _new_block_manager(self, num_blocks: int) -> BlockManager:
        cache = self.config.cache
        return BlockManager(cache.block_size, num_blocks, enable_prefix_caching=cache.enable_prefix_caching,
                            watermark=cache.watermark, pin_budget=int(cache.kv_pin_max_fraction * num_blocks),
                            pin_ttl_s=cache.kv_pin_ttl_s, tier_slots=getattr(self.executor, "num_tier_slots", 0),
                            num_state_slots=self.config.scheduler.max_num_seqs if self.model_info.hybrid else 0,
                            num_state_snapshots=cache.num_state_snapshots if self.model_info.hybrid else 0)

    def fail(self, exc: BaseException) -> list[RequestOutput]:
        """Marks the engine dead and ends every in-flight request with "error" (blocks freed); returns
        their final outputs. Used by AsyncEngine's stall watchdog once the stalled step has returned."""
        if self._dead is not None:
            return []
        return self._fail(exc)

    def _fail(self, exc: BaseException) -> list[RequestOutput]:
        self._in_flight = None   # its sequences end here; a stalled executor is not waited for again
        self._dead = exc
        self.transfers.fail_all(self.block_manager, exc)
        logger.error("the engine is dead: %s: %s", type(exc).__name__, exc, exc_info=exc)
        message = ENGINE_DEAD_MESSAGE
        failed = [r for r in self.scheduler.abort_all(FinishReason.ERROR) if r.request_id not in self._warm_up_ids]
        self._warm_up_ids.clear()
        self.plan_builder.forget_all()
        self._num_finished += len(failed)
        return [replace(self.output_builder.make(r, error=message), engine_failed=True) for r in failed]

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(ENGINE_DEAD_MESSAGE)

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
        spec = sched.speculation
        query_before, hit_before = self._prefix_totals_before
        query, hit = query_before + bm_stats.prefix_query_tokens, hit_before + bm_stats.prefix_hit_tokens
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_blocks=bm_stats.num_blocks,
            num_free_blocks=bm_stats.num_free_blocks,
            kv_usage=bm_stats.usage,
            prefix_hit_rate=hit / query if query else 0.0,
            prefix_query_tokens_total=query,
            prefix_hit_tokens_total=hit,
            num_preemptions_total=sched.num_preemptions,
            num_prompt_tokens_total=sched.num_prompt_tokens,
            num_generation_tokens_total=sched.num_generated_tokens,
            num_computed_tokens_total=sched.num_computed_tokens,
            num_steps_total=self._num_steps,
            num_requests_finished_total=self._num_finished,
            num_rank_restarts_total=self.num_rank_restarts,
            queue_time_buckets=sched.queue_time.cumulative(),
            queue_time_sum_s=sched.queue_time.sum_s,
            queue_time_count=sched.queue_time.count,
            spec_decode_num_drafts_total=spec.num_drafts,
            spec_decode_num_draft_tokens_total=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens_total=spec.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(
                (i, proposed, accepted) for i, (proposed, accepted)
                in enumerate(zip(spec.proposed_per_position, spec.accepted_per_position))),
            tenants=() if sched.fair is None else sched.fair.stats(sched.waiting, sched.running),
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
