#!/usr/bin/env bash
# Every GPU check in one command, for a short lease on a CUDA machine with no network and no Ray
# (docs/gpu.md). Run from the repository root:
#
#   bash benchmarks/gpu_check.sh quick   # install, then the stages in STAGES (default below)
#   bash benchmarks/gpu_check.sh full    # the same, with benchmarks.gpu_engine at its full shape if "engine" is asked
# Stages: "kv8goal" (benchmarks.kv8_goal: issue #37's goal shape alone, bf16 against the 8-bit decode's default
# and its best-ranked candidates, interleaved rounds), "tests" (the -m gpu tests; they include LoRA's Triton
# product and the engine with adapters on CUDA, never run on a GPU yet), "engine"
# (benchmarks.gpu_engine), "moe" (benchmarks.moe_kernel: the fused-MoE kernel against the loop over experts,
# 4-bit packed experts against bf16 ones), "kv8" (benchmarks.kv8_kernel: decode over an 8-bit KV cache against
# bf16 at 9 shapes, and prefill), "kvsweep" (benchmarks.kernel_sweep over each 8-bit cache's tiles, warps, code
# conversions and float16 products at the goal shape, then the two fastest at 2 to 4 splits), "qgemm"
# (benchmarks.quant_gemm: 4- and 8-bit weight GEMM against dense bf16), "spec" (benchmarks.spec_decode; needs
# the SmolLM2 folder, ~/.cache/pagedray, which a lent machine lacks) and "hoststep" (benchmarks.host_step on the
# lent machine's CPU: the engine's host work per decode step at batch 64 / 256 / 512 with the forward stubbed,
# issue #60; run it next to "engine", whose busy fraction it explains) and "lora" (benchmarks.lora_kernel: the
# LoRA product of a 64-row batch over 8 adapters against the layer alone and the dense-merged product, after
# checking it against the dense reference; then benchmarks.lora --random-qwen3: 8 adapters of rank 16 against
# the base model with 64 requests at once, the issue #63 goal >= 0.85x) and "delta" (benchmarks.gated_delta_kernel:
# the chunked Triton gated delta rule that prefill steps of Qwen3.5 / 3.6 run, against the recurrent kernel and the
# torch path, issue #67; never run on a GPU yet) and "families" (benchmarks.gpu_families: Qwen3.5, gpt-oss (bf16 and
# MXFP4 experts) and Gemma 4 against a dense Qwen3 of the same shape, throughput and a 4k prefill, issue #67) and
# "tier" (benchmarks.kv_host_tier: the pinned host-memory second KV tier's save / load rates against a pinned copy,
# and how much of a forward its side-stream copies overlap, issue #64; never run on a GPU yet).
#
# Logs and JSON go to $OUT (default gpu_out/): run.log holds everything printed, *.json the figures.
# Wheels in .whl/ (platformdirs, which the project needs and such an image may lack) are installed
# first when present. KV8GOAL_S, TEST_S, BENCH_S, MOE_S, KV8_S, KVSWEEP_S (each half), QGEMM_S, SPEC_S, HOSTSTEP_S and LORA_S bound
# the stages in seconds, so that a stage that hangs or crawls still leaves the others' output; every result
# is printed as it comes (DELTA_S bounds "delta", FAMILIES_S "families", TIER_S "tier"). A lease is 15 minutes of device time, the machine's start included, and one call
# at most 10: the default STAGES="kv8goal tests kv8" takes about 6 minutes on an H100 with a cold Triton cache
# (2026-11-27: kv8goal ~1.5, the tests over 3.7 cold and 2.4 warm, kv8 ~0.5), leaving room to rerun one stage after
# a fix. The others: STAGES="engine moe", then "qgemm".
set -u
mode=${1:-quick}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
git log -1 --format='commit %h %s' 2>/dev/null || true
stages=" ${STAGES:-kv8goal tests kv8} "
wanted() { [[ "$stages" == *" $1 "* ]]; }

if wanted kv8goal; then
echo "== benchmarks.kv8_goal (batch 64, 8k: the 8-bit decode against bf16) =="
# KV8GOAL_CANDIDATES: kv8_goal's candidates to time alone, "|" between names (e.g. "default" after changing it)
only=()
if [[ -n "${KV8GOAL_CANDIDATES:-}" ]]; then IFS="|" read -ra names <<< "$KV8GOAL_CANDIDATES"; only=(--candidates "${names[@]}"); fi
timeout "${KV8GOAL_S:-300}" python3 -m benchmarks.kv8_goal --rounds 5 --out "$OUT/kv8_goal.json" "${only[@]}"
echo "kv8_goal exit: $?"
fi

if wanted lora; then
echo "== benchmarks.lora_kernel (a 64-row batch over 8 adapters of rank 16: LoRA against base and dense-merged) =="
timeout "${LORA_S:-300}" python3 -m benchmarks.lora_kernel --rounds 3 --out "$OUT/lora_kernel.json"
echo "lora_kernel exit: $?"
echo "== benchmarks.lora --random-qwen3 (8 adapters of rank 16 against the base model, 64 requests at once) =="
timeout "${LORA_S:-300}" python3 -m benchmarks.lora --random-qwen3 --num-requests 64 --max-tokens 128 --rounds 3 \
    --out "$OUT/lora.json"
echo "lora exit: $?"
fi

if wanted hoststep; then
echo "== benchmarks.host_step (the host part of a decode step, forward stubbed, on this machine's CPU) =="
lscpu | grep -m1 "Model name" || true
timeout "${HOSTSTEP_S:-240}" python3 -m benchmarks.host_step --rounds 3 --steps 16 --out "$OUT/host_step.json"
echo "host_step exit: $?"
fi

if wanted tests; then
echo "== -m gpu tests =="
parallel=()    # pytest-xdist where the image has it: Triton compiles the kernel variants on the CPU cores
python3 -c "import xdist" 2>/dev/null && parallel=(-n "$(( $(nproc) > 8 ? 8 : $(nproc) ))")
timeout "${TEST_S:-360}" python3 -m pytest -q -p no:cacheprovider -m gpu "${parallel[@]}" --timeout 150 -rfEs \
    ${TESTS:-tests/kernels tests/workers/test_worker_gpu.py}
echo "tests exit: $?"
fi

if wanted engine; then
echo "== benchmarks.gpu_engine ($mode) =="
if [ "$mode" = quick ]; then
    timeout "${BENCH_S:-200}" python3 -m benchmarks.gpu_engine --num-seqs 32 --skip-hf --out "$OUT/gpu.json"
else
    timeout "${BENCH_S:-420}" python3 -m benchmarks.gpu_engine --hf-max-s 30 --out "$OUT/gpu.json"
fi
echo "gpu_engine exit: $?"
fi

if wanted delta; then
echo "== benchmarks.gated_delta_kernel (Qwen3.5's linear-attention layer: chunked against recurrent, prefill steps) =="
timeout "${DELTA_S:-150}" python3 -m benchmarks.gated_delta_kernel --out "$OUT/gated_delta_kernel.json"
echo "gated_delta_kernel exit: $?"
fi

if wanted families; then
echo "== benchmarks.gpu_families (the 2026 families against a dense model of their shape, bf16, graphs) =="
timeout "${FAMILIES_S:-420}" python3 -m benchmarks.gpu_families --out "$OUT/gpu_families.json"
echo "gpu_families exit: $?"
fi

if wanted tier; then
echo "== benchmarks.kv_host_tier (the pinned host-memory KV tier: copy rates and overlap with a forward) =="
timeout "${TIER_S:-120}" python3 -m benchmarks.kv_host_tier --out "$OUT/kv_host_tier.json"
echo "kv_host_tier exit: $?"
fi

if wanted moe; then
echo "== benchmarks.moe_kernel =="
timeout "${MOE_S:-120}" python3 -m benchmarks.moe_kernel --out "$OUT/moe_kernel.json"
echo "moe_kernel exit: $?"
fi

if wanted kv8; then
echo "== benchmarks.kv8_kernel =="
timeout "${KV8_S:-240}" python3 -m benchmarks.kv8_kernel --out "$OUT/kv8_kernel.json"
echo "kv8_kernel exit: $?"
fi

if wanted kvsweep; then
for code in int8 fp8_e4m3; do
echo "== benchmarks.kernel_sweep --cache-dtype $code (decode, batch 64, 8k) =="
timeout "${KVSWEEP_S:-200}" python3 -m benchmarks.kernel_sweep --cache-dtype "$code" --decode-shapes 64x8192 \
    --decode-only --out "$OUT/sweep_$code.json"
echo "kernel_sweep exit: $?"
done
fi

if wanted qgemm; then
echo "== benchmarks.quant_gemm =="
timeout "${QGEMM_S:-180}" python3 -m benchmarks.quant_gemm --out "$OUT/quant_gemm.json"
echo "quant_gemm exit: $?"
fi

if wanted spec; then
echo "== benchmarks.spec_decode =="
timeout "${SPEC_S:-150}" python3 -m benchmarks.spec_decode --rounds 3 --max-tokens 64 --out "$OUT/spec_decode.json"
echo "spec_decode exit: $?"
fi
