#!/usr/bin/env bash
# The GPU proof on real vLLM (CUDA): what docs/hardware.md "Real vLLM on one H200" records, in one command.
#
#   scripts/gpu-proof.sh --engine=vllm [OUT_DIR]          (this script; OUT_DIR defaults to $OUT or /tmp/gpu-proof)
#
# Needs the parts of scripts/pack-vllm-cuda.sh staged on this machine (scripts/gpu-vllm-cuda.sh stage, one part
# per device call); installs them (offline, once per machine), then runs the suites named in PDSERVE_PROOF_SUITES
# (default: all, in this order), every cluster on the one GPU (--pd-share-gpus):
#   examples     pytest examples --pd-engine=vllm
#   contract     pytest tests/test_contract.py (the [vllm] half runs real vLLM; [sim] the simulator in the same run)
#   edge         vLLM's test_edge_cases.py        --pd-export-env --pd-preset=vllm-edge-case
#   mamba        vLLM's test_mamba_prefix_cache.py --pd-export-env --pd-preset=vllm-mamba-prefix-cache
#   multi        vLLM's test_multi_connector_edge_cases.py --pd-export-env --pd-preset=vllm-multi-connector-edge-case
#   determinism  tests/gpu/vllm/test_determinism_matrix.py on FLASH_ATTN and TRITON_ATTN
#   faithful     tests/gpu/vllm/test_kv_faithful_matrix.py (the break matrix of docs/faithful-kv.md) on FLASH_ATTN,
#                TRITON_ATTN and FLASHINFER (PDSERVE_PROOF_BACKENDS overrides the list)
# vLLM's modules come from .cache/vllm-tests/<version>/nixl_integration (scripts/fetch-vllm-tests.sh VERSION, run
# where PyPI is reachable; carry ".cache/vllm-tests").
# Files written to OUT_DIR (flat, at most 8): machine.txt, <suite>.log per suite (the last suites' logs are
# appended to suites.log), gpu-memory.csv (nvidia-smi every second), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${1:-${OUT:-/tmp/gpu-proof}}
mkdir -p "$out"
suites=${PDSERVE_PROOF_SUITES:-examples contract edge mamba multi determinism faithful}
per_suite=${PDSERVE_PROOF_TIMEOUT:-560}
for s in $suites; do
  case $s in examples|contract|edge|mamba|multi|determinism|faithful) ;; *)
    echo "gpu-proof: unknown suite '$s' in PDSERVE_PROOF_SUITES (examples contract edge mamba multi determinism" \
      "faithful)" >&2
    exit 2;; esac
done

bash scripts/gpu-vllm-cuda.sh install || exit $?
vllm=$(bash scripts/gpu-vllm-cuda.sh path)
py=$(dirname "$vllm")/python
stage=${PDSERVE_VLLM_CUDA_STAGE:-/tmp/pdserve-vllm-cuda}
# vLLM 0.26's GPU sampler imports flashinfer unless told not to, and flashinfer is not packed.
# NVLink multicast stays off on the lent machines (the device tool's KINDS.md says why).
export PDSERVE_VLLM_EXECUTABLE=$vllm VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  PDSERVE_CACHE_DIR=$stage/cache
unset CUDA_VISIBLE_DEVICES PDSERVE_SIMULATE_GPUS PDSERVE_PLATFORM PDSERVE_ENGINE ATTENTION_BACKEND VLLM_SERVE_EXTRA_ARGS
version=$("$py" -c 'import importlib.metadata as m; print(m.version("vllm"))')
mods=$repo/.cache/vllm-tests/$version/nixl_integration

{
  echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname) kernel $(uname -r) cpus $(nproc)"
  echo "--- nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total,memory.used"
  nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total,memory.used --format=csv,noheader
  "$py" -c 'import sys, torch, vllm, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "vllm", vllm.__version__, "transformers", transformers.__version__)'
  "$py" -m pip list 2>/dev/null | grep -Ei '^(nixl|nixl-cu13|pytest|pytest-pdserve|triton|tokenizers) '
  echo "suites: $suites"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 1000 >>"$out/gpu-memory.csv" 2>&1 &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT

base=(-p no:cacheprovider -v -rA --durations=0 --pd-share-gpus --pd-startup-timeout=420)
common=("${base[@]}" --pd-engine=vllm)
run_suite() {  # name, then the pytest command's arguments; runs from the directory in $where
  local name=$1; shift
  local t0=$SECONDS rc
  echo "=== $name: pytest $* (in $where)" | tee -a "$out/$name.log"
  (cd "$where" && timeout "$per_suite" "$py" -m pytest "$@") >>"$out/$name.log" 2>&1
  rc=$?
  local line
  line=$(grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$out/$name.log" | tail -1)
  echo "$name: exit $rc after $((SECONDS - t0)) s: ${line:-no pytest summary (timeout $per_suite s?)}" | tee -a "$out/summary.txt"
  grep -E "^pdserve: cluster .* ready in|PASSED|FAILED|SKIPPED|ERROR" "$out/$name.log" | head -60 >>"$out/summary.txt"
  return 0
}
module_suite() {  # name, module file, preset
  [ -f "$mods/$2" ] || { echo "$1: $mods/$2 missing (scripts/fetch-vllm-tests.sh $version, carry .cache/vllm-tests)" \
    | tee -a "$out/summary.txt"; return 0; }
  where=$mods run_suite "$1" "$2" --pd-export-env "--pd-preset=$3" "${common[@]}"
}

for s in $suites; do
  case $s in
    # One GPU holds one real cluster at a time: the mamba example's hybrid cluster goes last, so `pd` is started
    # once instead of twice (each real start is 100-180 s). PDSERVE_PROOF_EXAMPLES_ORDER=file keeps file order,
    # which proves the stop and fresh restart of `pd` instead.
    examples)
      if [ "${PDSERVE_PROOF_EXAMPLES_ORDER:-grouped}" = file ]; then ex=(examples)
      else ex=($(cd "$repo" && ls examples/test_*.py | grep -v mamba) examples/rocm examples/test_mamba_prefix_cache.py); fi
      where=$repo run_suite examples "${ex[@]}" "${common[@]}" ;;
    contract) where=$repo run_suite contract tests/test_contract.py "${base[@]}" ;;
    edge) module_suite edge test_edge_cases.py vllm-edge-case ;;
    # The script's FLASHINFER is not packed (its JIT needs minutes of nvcc per kernel), and its 0.8 memory fraction
    # twice does not fit one GPU: the CI variables the script honours set both, as a CI job would.
    mamba) ATTENTION_BACKEND=FLASH_ATTN GPU_MEMORY_UTILIZATION=0.4 \
             module_suite mamba test_mamba_prefix_cache.py vllm-mamba-prefix-cache ;;
    # vLLM 0.26 refuses the cross-layer LBHNC and its own script sets HND; 0.32 accepts LBHNC. Releases in between
    # were not checked, so they get HND too (presets._layout says why).
    multi) layout=$("$py" -c 'import vllm, sys; v = tuple(int(x) for x in vllm.__version__.split(".")[:2]); print("HND" if v < (0, 32) else "")')
           VLLM_KV_CACHE_LAYOUT=$layout module_suite multi test_multi_connector_edge_cases.py vllm-multi-connector-edge-case ;;
    determinism)
      for backend in FLASH_ATTN TRITON_ATTN; do
        where=$repo ATTENTION_BACKEND=$backend run_suite "determinism-$backend" tests/gpu/vllm/test_determinism_matrix.py \
          "${common[@]}"
      done ;;
    faithful)
      for backend in ${PDSERVE_PROOF_BACKENDS:-FLASH_ATTN TRITON_ATTN FLASHINFER}; do
        where=$repo ATTENTION_BACKEND=$backend run_suite "faithful-$backend" tests/gpu/vllm/test_kv_faithful_matrix.py \
          "${common[@]}" -s
      done ;;
  esac
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader >"$out/apps-after.txt" 2>&1
echo "compute apps after the run: $(cat "$out/apps-after.txt" | xargs)" | tee -a "$out/summary.txt"
# At most 8 files come back: fold all suite logs into one.
for f in "$out"/*.log; do { echo "##### $(basename "$f")"; cat "$f"; } >>"$out/suites.log.tmp"; rm -f "$f"; done
[ -f "$out/suites.log.tmp" ] && mv "$out/suites.log.tmp" "$out/suites.log"
xz -9 -f "$out/suites.log" 2>/dev/null || true
rm -f "$out/apps-after.txt"
