"""Worker: one tensor-parallel rank (plain class; ``ray_worker.RayWorker`` wraps it in an actor).

Life cycle: ``__init__`` (pin threads, validate, join the TP group, load this rank's weight shard)
-> ``available_kv_blocks`` (engine takes the min over ranks) -> ``init_kv_cache(num_blocks)`` ->
``execute(plan)`` per step -> ``shutdown``.

Decisions: docs/design/workers.md, ``pagedray.workers.worker``.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, wait
from dataclasses import replace

import torch
from pagedray.kernels import kv_quant

from .contract.config import EngineConfig
from .contract.wire import PENDING_TOKEN, LoraRead, SampledToken, StepPlan, StepResult, decode_plan, encode_result
from .host_memory import keep_freed_memory
from .kv_blocks import read_blocks, reshard_rows, write_blocks
from .kv_host_tier import HostTierStore
from .kv_tier import KVTierStore, open_tier_store
from .layers.packed_gemm import PackReport
from .layers.partition import HeadPartition
from .lora.model_lora import ModelLora
from .models.model_info import load_hf_config, model_info
from .models.model_loading import kv_cache_spec, load_model, pack_for_cpu, settle_cpu_decode
from .models.registry import model_class
from .runner.decode_graphs import CaptureReport, DecodeGraphs
from .runner.draft_model import DraftModel
from .runner.memory_profile import profile_gpu_num_blocks
from .runner.model_runner import ModelRunner, StepOutput
from .sampling.grammar import GrammarBook
from .sampling.sampler import PLACEHOLDER_TOKEN, Sampler, SamplingRow
from .sampling.speculative import cut_after_errors, verify
from .tp_group import TPGroup
from .weights.default_model import resolve_model_path
from .weights.dtype_choice import resolve_dtype

# a plan with nothing to run while an adapter read is in flight: how long rank 0 waits for the read to finish
# before it answers (the pace of an engine whose only work is waiting for adapters, not a deadline)
LORA_READ_POLL_S = 0.02

log = logging.getLogger(__name__)

def resolve_device(device: str, rank: int) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was requested but no CUDA device is available")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, dist_init_method: str | None = None) -> None:
        tp_size = config.parallel.tensor_parallel_size
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank: must be in [0, tensor_parallel_size={tp_size}), got {rank}")
        self.config = config
        self.rank = rank
        self.device = resolve_device(config.model.device, rank)
        self.dtype_choice = resolve_dtype(config.model.dtype, self.device)
        self.dtype = self.dtype_choice.dtype
        log.info("rank %d: %s", rank, self.dtype_choice.reason)
        model_path = resolve_model_path(config.model.model)
        hf_config = load_hf_config(model_path)
        cls = model_class(hf_config)
        self.max_model_len = config.model.max_model_len or hf_config.max_position_embeddings
        cls.validate_config(hf_config, self.max_model_len, tp_size)
        torch.set_num_threads(config.parallel.threads_per_worker or max(1, (os.cpu_count() or 1) // tp_size))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif config.model.cpu_keep_freed_memory:
            keep_freed_memory()
        self.model, self.tp, quantization = load_model(
            model_path, hf_config, config.model.quantization, self.dtype, self.device, self.max_model_len,
            lambda: TPGroup.join(rank, tp_size, self.device, dist_init_method))
        if quantization.method != "none":
            log.info("rank %d: %s weights (%d bits), dequantized to %s when loaded", rank, quantization.method,
                     quantization.bits, self.dtype)
        if config.model.enable_lora:
            ModelLora.attach(self.model, config.model.max_loras, config.model.max_lora_rank)
        self.pack_report: PackReport | None = pack_for_cpu(self.model, config.model, config.scheduler.max_num_seqs,
                                                           self.dtype, self.device)
        if self.pack_report is not None:
            log.info("rank %d: %d weight matrices packed (%.0f MB of packed copies next to %.0f MB "
                     "of weights)", rank, self.pack_report.matrices, self.pack_report.packed_bytes / 1e6,
                     self.pack_report.weight_bytes / 1e6)
        self.drafter: DraftModel | None = None
        if config.scheduler.speculative_model is not None:
            self.drafter = DraftModel(config.scheduler.speculative_model, config, self.model,
                                      self.tp, self.dtype, self.device, self.max_model_len)
        # a hybrid model: its linear layers' state pool, one slot per sequence the scheduler may run and one per
        # prefix-cache snapshot (the engine's block manager hands out the same slots: cluster/hybrid.py), allocated
        # before the KV cache is sized
        self.state_bytes = self._allocate_states(config) if hasattr(self.model, "allocate_states") else 0
        self.kv_spec = kv_cache_spec(self.model, config.cache.block_size,
                                     kv_quant.cache_dtype(config.cache.kv_cache_dtype, self.dtype))
        self.sampler = (Sampler(seed=config.seed, eos_token_ids=model_info(model_path).eos_token_ids)
                        if self.tp.is_first else None)
        self.grammars = GrammarBook(str(config.model.tokenizer or model_path)) if self.tp.is_first else None
        self.runner: ModelRunner | None = None
        # the second KV tier (kv_offload_gib), once the cache exists
        self.kv_tier: KVTierStore | HostTierStore | None = None
        self.graph_report: CaptureReport | None = None
        self._last_sampled: list[SampledToken] = []   # rank 0: what its last step drew (the list it returned)

    @property
    def uses_decode_graphs(self) -> bool:
        return (self.device.type == "cuda" and not self.config.model.enforce_eager
                and self.config.parallel.tensor_parallel_size == 1 and getattr(self.model, "graph_safe", True))

    def _allocate_states(self, config: EngineConfig) -> int:
        """The hybrid model's state slots (``max_num_seqs`` seats + the prefix cache's snapshots); their bytes on
        this rank. ValueError naming both options when the device cannot hold them."""
        seats, snapshots = config.scheduler.max_num_seqs, config.cache.num_state_snapshots
        try:
            return self.model.allocate_states(seats + snapshots)
        except (RuntimeError, MemoryError) as exc:   # torch's allocators (CPU and CUDA out-of-memory) raise these
            raise ValueError(f"max_num_seqs / hybrid_prefix_states: {seats} + {snapshots} recurrent-state slots do not "
                             f"fit on this rank's {self.device.type} ({str(exc).splitlines()[0][:200]}); lower "
                             "either") from None

    def available_kv_blocks(self) -> int:
        """KV blocks this rank can hold (collective on GPU with TP > 1: call on every rank). With a draft
        model a block id holds K/V in both caches, so the memory is shared out in proportion."""
        if self.config.cache.num_blocks is not None:
            return self.config.cache.num_blocks
        if self.device.type == "cpu":
            blocks = self.kv_spec.blocks_for_bytes(self.config.cache.kv_cache_gib * 2**30)
        else:
            graph_rows = self.config.scheduler.max_num_seqs if self.uses_decode_graphs else None
            blocks = profile_gpu_num_blocks(self.model, self.kv_spec, self.config, self.max_model_len, self.device,
                                            graph_rows)
        if self.drafter is None:
            return blocks
        own = self.kv_spec.bytes_per_block
        return blocks * own // (own + self.drafter.kv_spec.bytes_per_block)

    def kv_tier_slots(self) -> int:
        """Blocks the second KV tier holds on this rank (``kv_offload_gib`` of this rank's block bytes; 0: off)."""
        return int(self.config.cache.kv_offload_gib * 2**30 // self.kv_spec.bytes_per_block)

    def init_kv_cache(self, num_blocks: int) -> None:
        kv_cache = self.kv_spec.allocate(num_blocks, self.device)
        if self.kv_tier_slots():
            self.kv_tier = open_tier_store(kv_cache, self.config.cache.kv_offload_path, self.rank, self.kv_tier_slots())
        settle_cpu_decode(self.model, kv_cache, self.config.cache.block_size)
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks)
        self.runner = ModelRunner(self.model, kv_cache, self.config.cache.block_size, self.device, self.drafter)
        if self.uses_decode_graphs:
            graphs = DecodeGraphs(self.model, kv_cache, self.config.cache.block_size,
                                  self.config.scheduler.max_num_seqs, self.max_model_len, self.device)
            self.graph_report = graphs.capture()
            self.runner.use_decode_graphs(graphs)

    def execute(self, plan: StepPlan) -> StepResult | None:
        if self.runner is None:
            raise RuntimeError("Worker.execute: call init_kv_cache(num_blocks) first")
        if self.kv_tier is not None:
            self.kv_tier.wait_loads()          # earlier steps' tier loads land before this step reads the cache
        tier_failures, load_s = self._move_tier_blocks(plan)
        exported = self._export_blocks(plan.kv_exports)
        self._import_blocks(plan)
        plan = self._resolve_pending(plan)
        if not self.tp.is_first:
            self.runner.execute(plan)
            if self.model.lora is not None:
                self.model.lora.finished_reads()    # only rank 0 reports them; the others drop failed copies
            return None
        self.grammars.release(plan.released_seq_ids)
        step = self.runner.prepare(plan)
        if step is None or (not step.host.row_drafts and (self.runner.mirror.all_plain_greedy
                                                          or _all_plain_greedy(step.host.sampling_seqs))):
            output = self.runner.run(step)       # no grammar, processor or logprobs (or no rows): one argmax
            seq_ids = [state.seq_id for state in output.sampling_seqs]
            sampled = [] if output.logits is None else self.sampler.argmax(seq_ids, output.logits)
            self._last_sampled = sampled
            return StepResult(step_id=plan.step_id, sampled=sampled, prompt_logprobs=output.prompt_logprobs,
                              lora_reads=self._finished_lora_reads(step is None), kv_load_failures=tier_failures,
                              kv_load_seconds=load_s, kv_export=exported, pooled=output.pooled)
        rows = [] if step is None else _sampling_rows(step.host.sampling_seqs, step.host.row_drafts)
        masks = self.grammars.submit(rows)   # grammar masks on their own thread while the forward runs
        try:
            output = self.runner.run(step)
        except BaseException:
            if masks is not None:
                wait([masks])   # the mask thread is done with the matchers before anything else touches them
            raise
        sampled = self._last_sampled = self.sample(output, rows, masks)
        return StepResult(step_id=plan.step_id, sampled=sampled, prompt_logprobs=output.prompt_logprobs,
                          lora_reads=self._finished_lora_reads(False), kv_load_failures=tier_failures,
                          kv_load_seconds=load_s, kv_export=exported, pooled=output.pooled)

    def _move_tier_blocks(self, plan: StepPlan) -> tuple[list[int], float]:
        """The plan's second-tier saves, then its loads (``kv_tier.py``): (the slots whose load failed on any rank
        (a collective with TP > 1: every rank gets the same plan, so every rank takes part), the seconds this
        rank spent reading its loads)."""
        if not (plan.kv_saves or plan.kv_loads):
            return [], 0.0
        if self.kv_tier is None:
            raise ValueError("kv_saves / kv_loads: this rank has no second KV tier (kv_offload_gib is 0)")
        num_blocks = self.runner.kv_cache.num_blocks
        for block, slot in plan.kv_saves + [(block, slot) for slot, block in plan.kv_loads]:
            if not 0 <= block < num_blocks or slot < 0:
                raise ValueError(f"kv_saves / kv_loads: block {block} / slot {slot} outside the cache "
                                 f"(0..{num_blocks - 1}) or negative")
        self.kv_tier.save_many(plan.kv_saves)
        loaded, load_s = self.kv_tier.load_many(plan.kv_loads)
        failed = [0 if ok else 1 for ok in loaded]
        if self.tp.world_size > 1 and failed:
            flags = torch.tensor(failed, dtype=torch.int32, device=self.device)
            failed = self.tp.all_reduce(flags).tolist()
        return [slot for (slot, _), bad in zip(plan.kv_loads, failed) if bad], load_s

    def _export_blocks(self, blocks: list[int]) -> list[bytes]:
        """Rank 0: each rank's bytes of ``blocks`` (a collective with TP > 1: every rank reads its own shard and
        rank 0 gathers them); [] elsewhere and without exports. The draft model's cache is not exported."""
        if not blocks:
            return []
        rows = read_blocks(self.runner.kv_cache, blocks, host=False)              # [n, block_bytes] on the device
        gathered = self.tp.gather_to_first(rows)                                   # [n, world * block_bytes] on 0
        if gathered is None:
            return []
        return [part.cpu().numpy().tobytes() for part in gathered.chunk(self.tp.world_size, dim=1)]

    def _import_blocks(self, plan: StepPlan) -> None:
        """Writes ``plan.kv_imports`` from the source replica's shards: this rank's own when the TP sizes match,
        else its KV heads gathered from the source ranks that hold them (``kv_blocks.reshard_rows``)."""
        blocks, shards, source_tp = plan.kv_imports, plan.kv_import_shards, plan.kv_import_tp
        if not blocks:
            return
        if source_tp < 1 or len(shards) != source_tp:
            raise ValueError(f"kv_import_shards: {len(shards)} shards for kv_import_tp={source_tp}")
        rows = [torch.frombuffer(bytearray(shard), dtype=torch.uint8) for shard in shards]
        if any(r.numel() % len(blocks) for r in rows):
            raise ValueError(f"kv_import_shards: shard sizes {[r.numel() for r in rows]} do not split into "
                             f"{len(blocks)} blocks")
        rows = [r.reshape(len(blocks), -1) for r in rows]                          # per source rank [n, its bytes]
        world, dims, kv = self.tp.world_size, self.model.dims, self.runner.kv_cache
        if source_tp == world:
            own = rows[self.rank]
        else:
            partitions = [HeadPartition(dims.num_heads, dims.num_kv_heads, source_tp, s) for s in range(source_tp)]
            own = reshard_rows(kv, rows, partitions, HeadPartition(dims.num_heads, dims.num_kv_heads, world,
                                                                   self.rank))
        write_blocks(kv, blocks, own)

    def _finished_lora_reads(self, idle: bool) -> list[LoraRead]:
        """Rank 0: the adapter reads finished since its last result. A plan with nothing to run (``idle``: the
        engine is waiting for a read) first waits up to LORA_READ_POLL_S for one, so that an engine with
        nothing else to do does not spin."""
        lora = self.model.lora
        return [] if lora is None else lora.finished_reads(LORA_READ_POLL_S if idle else 0.0)

    def _resolve_pending(self, plan: StepPlan) -> StepPlan:
        """``plan`` with each ``PENDING_TOKEN`` replaced by the token this rank drew for that sequence at
        its last step."""
        decodes = plan.decodes
        pending_decodes = PENDING_TOKEN in decodes.token_ids
        if not pending_decodes and not any(delta.new_token_id == PENDING_TOKEN for delta in plan.running):
            return plan
        if not self.tp.is_first:
            raise ValueError(f"running: PENDING_TOKEN needs the sampling rank; rank {self.rank} draws no tokens")
        drawn = {token.seq_id: token.token_id for token in self._last_sampled}

        def last_draw(seq_id: int) -> int:
            token = drawn.get(seq_id)
            if token is None:
                raise ValueError(f"running: seq {seq_id} asks for the token drawn at the previous step, which "
                                 "drew none for it")
            return token
        running = [replace(delta, new_token_id=last_draw(delta.seq_id)) if delta.new_token_id == PENDING_TOKEN
                   else delta for delta in plan.running]
        if pending_decodes:
            tokens = [last_draw(seq_id) if token == PENDING_TOKEN else token
                      for seq_id, token in zip(decodes.seq_ids, decodes.token_ids)]
            decodes = replace(decodes, token_ids=tokens)
        return replace(plan, running=running, decodes=decodes)

    def sample(self, output: StepOutput, rows: list[SamplingRow] | None = None,
               masks: Future | None = None) -> list[SampledToken]:
        """Rank 0: one SampledToken per logits row of a step's output (grammar rows masked first; ``masks``:
        ``GrammarBook.submit``'s pending result, computed here when not given). A row that fails (its
        grammar, non-finite logits) carries ``error``: it ends its own request, never the step."""
        if output.logits is None:
            return []
        rows = _sampling_rows(output.sampling_seqs, output.row_drafts) if rows is None else rows
        grammar_masks = masks.result() if masks is not None else self.grammars.compute(rows)
        sampled = self.sampler(self.grammars.apply(output.logits, grammar_masks), rows)
        for i, message in (grammar_masks.failures if grammar_masks is not None else {}).items():
            sampled[i] = SampledToken(sampled[i].seq_id, PLACEHOLDER_TOKEN, error=message)
        kept, kept_rows = sampled, rows
        if output.row_drafts:                                      # a step with speculative drafts
            indices = verify(sampled, output.row_drafts)
            kept, kept_rows = [sampled[i] for i in indices], [rows[i] for i in indices]
        refused = self.grammars.advance(kept_rows, [token.token_id for token in kept], skip=_failed(kept))
        for k, message in refused.items():
            kept[k] = SampledToken(kept[k].seq_id, PLACEHOLDER_TOKEN, error=message)
        return cut_after_errors(kept) if refused else kept

    def execute_bytes(self, data: bytes) -> bytes | None:
        result = self.execute(decode_plan(data))
        return None if result is None else encode_result(result)

    def num_sequences(self) -> int:
        return 0 if self.runner is None else len(self.runner.mirror)

    def shutdown(self) -> None:
        """Releases the KV caches and the decode graphs (the runners hold them), so a new engine in the
        same process can profile the device memory again."""
        self.runner = self.drafter = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.kv_tier is not None:
            self.kv_tier.close()
        self.tp.destroy()


def _sampling_rows(seqs, row_drafts: tuple[tuple[int, ...], ...] = ()) -> list[SamplingRow]:
    """One SamplingRow per logits row; a row after speculative drafts sees them as output tokens."""
    if not row_drafts:
        return [SamplingRow(s.seq_id, s.params, s.prompt_token_ids, s.output_token_ids) for s in seqs]
    return [SamplingRow(s.seq_id, s.params, s.prompt_token_ids, s.output_token_ids + list(drafts) if drafts
                        else s.output_token_ids, len(drafts)) for s, drafts in zip(seqs, row_drafts)]


def _all_plain_greedy(seqs) -> bool:
    """Every sampling sequence is a plain argmax at its next token (``sampler.greedy_from``)."""
    return all(s.greedy_from is not None and len(s.output_token_ids) >= s.greedy_from for s in seqs)


def _failed(sampled: list[SampledToken]) -> frozenset[int]:
    return frozenset(i for i, token in enumerate(sampled) if token.error is not None)
