"""One run of ``benchmarks.fairness``'s workload on vLLM for CPU's engine, executed by the vLLM venv's Python.

Reads one JSON object on stdin: ``model`` (a folder), ``flood`` (whether the flood runs), ``light``,
``light_tokens``, ``light_interval_s``, ``flood_queue``, ``flood_tokens``, ``max_tokens``, ``seed``, ``vocab``,
``max_num_batched_tokens`` (None: vLLM's default) and ``gpu_memory_utilization``. Builds ``vllm.LLM`` (start-up
outside the timing), then drives its engine exactly as ``fairness.measure`` drives pagedray's: light requests
every ``light_interval_s`` on the wall clock, the flood topped up to ``flood_queue`` waiting prompts, steps back
to back. vLLM has no tenants: this is its default (FIFO) scheduler. Prints one line ``RESULT_PREFIX`` + JSON
(the light requests' TTFTs in ms, the flood's output tok/s). Imports nothing of pagedray's.
"""

import json
import random
import sys
import time

RESULT_PREFIX = "pagedray-vllm-fairness-result: "


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    kwargs = {"gpu_memory_utilization": job["gpu_memory_utilization"]}
    if job["max_num_batched_tokens"] is not None:
        kwargs["max_num_batched_tokens"] = job["max_num_batched_tokens"]
    llm = LLM(job["model"], **kwargs)
    engine = llm.llm_engine
    rng = random.Random(job["seed"])
    vocab = job["vocab"]
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    llm.generate([{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(32)]}], params, use_tqdm=False)
    arrivals, first, flood_ids, flood_waiting, flood_tokens = {}, {}, set(), set(), 0
    start = time.perf_counter()
    while len(first) < job["light"]:
        now = time.perf_counter() - start
        while len(arrivals) < job["light"] and now >= len(arrivals) * job["light_interval_s"]:
            rid = f"light-{len(arrivals)}"
            engine.add_request(rid, {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(job["light_tokens"])]},
                               params)
            arrivals[rid] = time.perf_counter()
        if job["flood"]:
            for _ in range(job["flood_queue"] - len(flood_waiting)):
                rid = f"flood-{len(flood_ids)}"
                prompt = [rng.randrange(2, vocab) for _ in range(job["flood_tokens"])]
                engine.add_request(rid, {"prompt_token_ids": prompt}, params)
                flood_ids.add(rid)
                flood_waiting.add(rid)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, len(arrivals) * job["light_interval_s"] - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            got = len(out.outputs[0].token_ids) if out.outputs else 0
            if out.request_id in arrivals and got and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            if out.request_id in flood_ids and got:
                flood_waiting.discard(out.request_id)     # started: no longer waiting (vLLM outputs are cumulative)
                if out.finished:
                    flood_tokens += got
    elapsed = time.perf_counter() - start
    ttfts = [1000 * (first[r] - arrivals[r]) for r in arrivals]
    print(RESULT_PREFIX + json.dumps({"ttfts_ms": ttfts, "flood_tok_s": flood_tokens / elapsed}), flush=True)


if __name__ == "__main__":
    main()
