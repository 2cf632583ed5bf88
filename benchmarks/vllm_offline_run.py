"""One offline run of vLLM for CPU's ``LLM.generate``, executed by the vLLM venv's Python (``vllm_cpu.py``).

Reads one JSON object on stdin: ``model`` (a folder), ``prompts``, ``max_tokens`` (one per prompt),
``dtype`` (None: vLLM's default) and ``env`` notes; builds ``vllm.LLM`` (start-up and compilation
outside the timing), warms it up with two short requests, then times ``generate`` over every prompt
(greedy, ``ignore_eos``) and prints one line ``RESULT_PREFIX`` + JSON (seconds, output_tokens): vLLM's
own processes print to the same stdout, before and after it. Imports nothing of pagedray's (it runs in
vLLM's own environment).
"""

import json
import sys
import time

RESULT_PREFIX = "pagedray-vllm-offline-result: "


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    kwargs = {"gpu_memory_utilization": job["gpu_memory_utilization"]}
    if job["dtype"] is not None:
        kwargs["dtype"] = job["dtype"]
    llm = LLM(job["model"], **kwargs)
    llm.generate(job["prompts"][:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in job["max_tokens"]]
    start = time.perf_counter()
    outputs = llm.generate(job["prompts"], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(RESULT_PREFIX + json.dumps({"seconds": seconds, "output_tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
