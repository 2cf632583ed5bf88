"""One run of ``benchmarks.agent_sessions``'s workload on vLLM for CPU's engine, executed by the vLLM venv's Python.

Reads one JSON object on stdin: the workload (``agent_workload.requests``' keys: ``sessions``, ``turns``,
``system_tokens``, ``turn_tokens``, ``max_tokens``, ``flood``, ``flood_tokens``, ``seed``, ``vocab``), ``model`` (a
folder), ``pool_tokens`` (the KV pool pagedray's systems get, in tokens: the workload needs a pool too small for
every context) and ``gpu_memory_utilization``. Builds ``vllm.LLM`` at its defaults otherwise (prefix caching on, an
LRU, its CPU block of 128 tokens; start-up outside the timing), with ``num_gpu_blocks_override`` giving the pool in
those blocks (and ``max_model_len`` cut to the pool when the pool is smaller than the model's: the dry run), then
runs the requests one at a time as ``agent_sessions.measure`` does.
A request's prefilled tokens are its prompt less vLLM's ``num_cached_tokens``. Prints one line ``RESULT_PREFIX``
+ JSON (mean TTFT of the turns >= 2 in ms, their prefilled tokens). Imports nothing of pagedray's.
"""

import json
import sys
import time
from pathlib import Path

RESULT_PREFIX = "pagedray-vllm-agent-sessions-result: "
CPU_BLOCK_SIZE = 128      # vLLM for CPU's block when none is given (vllm/platforms/cpu.py)


def main() -> None:
    job = json.load(sys.stdin)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from agent_workload import drive
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    pool = job["pool_tokens"]
    longest = AutoConfig.from_pretrained(job["model"]).max_position_embeddings
    llm = LLM(job["model"], gpu_memory_utilization=job["gpu_memory_utilization"],
              num_gpu_blocks_override=pool // CPU_BLOCK_SIZE, **({"max_model_len": pool} if pool < longest else {}))
    engine = llm.llm_engine
    block_size = engine.vllm_config.cache_config.block_size
    if block_size != CPU_BLOCK_SIZE:
        raise SystemExit(f"vLLM chose {block_size}-token blocks, not {CPU_BLOCK_SIZE}: the pool is not {pool} tokens")
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)

    def run_one(request_id, prompt, session):
        start = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        tokens, ttft, cached = [], None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids and ttft is None:
                    ttft = time.perf_counter() - start
                if out.finished:
                    tokens = list(out.outputs[0].token_ids)      # vLLM's outputs are cumulative
                cached = max(cached, out.num_cached_tokens or 0)
        return tokens, ttft, len(prompt) - cached

    ttfts, prefilled = drive(job, run_one)
    print(RESULT_PREFIX + json.dumps({"mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts), "prefill_tokens": prefilled}),
          flush=True)


if __name__ == "__main__":
    main()
