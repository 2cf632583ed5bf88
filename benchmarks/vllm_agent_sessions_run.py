"""One run of ``benchmarks.agent_sessions``'s workload on vLLM for CPU's engine, executed by the vLLM venv's Python.

Reads one JSON object on stdin: the workload (``agent_workload.requests``' keys: ``sessions``, ``turns``,
``system_tokens``, ``turn_tokens``, ``max_tokens``, ``flood``, ``flood_tokens``, ``seed``, ``vocab``), ``model`` (a
folder), ``num_blocks`` and ``block_size`` (the KV pool pagedray's systems get: the workload needs a pool too small
for every context) and ``gpu_memory_utilization``. Builds ``vllm.LLM`` at its defaults otherwise (prefix caching on,
an LRU; start-up outside the timing), then runs the requests one at a time as ``agent_sessions.measure`` does.
A request's prefilled tokens are its prompt less vLLM's ``num_cached_tokens``. Prints one line ``RESULT_PREFIX``
+ JSON (mean TTFT of the turns >= 2 in ms, their prefilled tokens). Imports nothing of pagedray's.
"""

import json
import sys
import time
from pathlib import Path

RESULT_PREFIX = "pagedray-vllm-agent-sessions-result: "


def main() -> None:
    job = json.load(sys.stdin)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from agent_workload import drive
    from vllm import LLM, SamplingParams

    llm = LLM(job["model"], gpu_memory_utilization=job["gpu_memory_utilization"], block_size=job["block_size"],
              num_gpu_blocks_override=job["num_blocks"])
    engine = llm.llm_engine
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
