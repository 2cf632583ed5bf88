"""GPU KV capacity: free memory after a profiling forward at the largest step the scheduler can send.

The profile runs one forward of ``max_num_batched_tokens`` tokens split over
``min(max_num_seqs, tokens)`` sequences (each no longer than ``max_model_len``), all sampling, with a
throw-away KV cache just big enough for them. Then

    budget = total * gpu_memory_utilization - (peak_torch - profile_kv) - memory_not_owned_by_torch

where ``peak_torch`` includes the weights and the activations of that step and
``memory_not_owned_by_torch`` (CUDA context, NCCL buffers, other processes) is ``total - free - reserved``.
With TP > 1 the profile forward is collective: every rank must call it at the same time.

With decode CUDA graphs (``graph_rows`` = the largest bucket), the budget also sets aside what the
graphs will hold for good: the activations of one padded decode forward of ``graph_rows`` rows at the
full block-table width (measured the same way, over a one-block cache) plus the static logits and input
buffers. The graph pool is captured after the KV cache exists, so it is estimated here, not measured;
``DecodeGraphs.capture`` logs the real figure.
"""

from __future__ import annotations

import torch

from ..contract.config import EngineConfig
from ..contract.sampling_params import SamplingParams
from ..kv_cache import KVCacheSpec
from ..models.decoder import DecoderForCausalLM
from .input_batch import PackedShape, build_batch, build_host_batch
from .seq_mirror import BatchedSequence, SequenceState


def _profile_batch(num_tokens: int, num_seqs: int, block_size: int) -> tuple[list[BatchedSequence], int]:
    per_seq = -(-num_tokens // num_seqs)
    batch, next_block = [], 0
    params = SamplingParams(temperature=0.0)
    while num_tokens > 0:
        n = min(per_seq, num_tokens)
        blocks = -(-n // block_size)
        state = SequenceState(len(batch), [0] * n, [], 0, list(range(next_block, next_block + blocks)), params)
        batch.append(BatchedSequence.of(state, n))
        next_block += blocks
        num_tokens -= n
    return batch, next_block


@torch.inference_mode()
def decode_graph_bytes(model: DecoderForCausalLM, spec: KVCacheSpec, rows: int, max_model_len: int,
                       device: torch.device) -> int:
    """Estimated device memory of the decode graphs: largest bucket's activations + static buffers."""
    width = -(-max_model_len // spec.block_size)
    kv = spec.allocate(1, device)                       # padding rows read block 0 and write nothing
    inputs = build_host_batch([], spec.block_size, rows=rows, width=width).to_device(device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model.compute_logits(model(inputs.input_ids, inputs.positions, kv, inputs.meta))
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before
    static = rows * model.dims.vocab_size * 4 + PackedShape(rows, rows, rows, width).size * 4
    return activations + static


@torch.inference_mode()
def profile_gpu_num_blocks(model: DecoderForCausalLM, spec: KVCacheSpec, config: EngineConfig,
                           max_model_len: int, device: torch.device, graph_rows: int | None = None) -> int:
    num_tokens = config.scheduler.max_num_batched_tokens
    num_seqs = max(min(config.scheduler.max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    batch, num_blocks = _profile_batch(num_tokens, num_seqs, spec.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    kv = spec.allocate(num_blocks, device)
    inputs = build_batch(batch, spec.block_size, device)
    hidden = model(inputs.input_ids, inputs.positions, kv, inputs.meta)
    model.compute_logits(hidden[inputs.logits_indices])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - num_blocks * spec.bytes_per_block   # less the cache itself
    del kv, inputs, hidden
    torch.cuda.empty_cache()
    graphs = 0 if graph_rows is None else decode_graph_bytes(model, spec, graph_rows, max_model_len, device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    not_torch = total - free - torch.cuda.memory_reserved(device)
    budget = total * config.cache.gpu_memory_utilization - peak - graphs - not_torch
    return spec.blocks_for_bytes(budget)
