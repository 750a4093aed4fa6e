#!/usr/bin/env bash
# The GPU proof on real vLLM (CUDA): what docs/hardware.md "Real vLLM" records, one command per device call.
#
#   scripts/gpu-proof.sh --engine=vllm [OUT_DIR]          (this script; OUT_DIR defaults to $OUT or /tmp/gpu-proof)
#
# Needs the parts of scripts/pack-vllm-cuda.sh staged on this machine (scripts/gpu-vllm-cuda.sh stage, one part
# per device call); installs them (offline, once per machine), then runs the suites named in PDSERVE_PROOF_SUITES
# (default: all, in this order), every cluster on the one GPU (--pd-share-gpus):
#   examples     pytest examples --pd-engine=vllm
#   contract     pytest tests/sim/test_contract.py (the [vllm] half runs real vLLM; [sim] the simulator in the same run)
#   edge         vLLM's test_edge_cases.py        --pd-export-env --pd-preset=vllm-edge-case
#   mamba        vLLM's test_mamba_prefix_cache.py --pd-export-env --pd-preset=vllm-mamba-prefix-cache
#   multi        vLLM's test_multi_connector_edge_cases.py --pd-export-env --pd-preset=vllm-multi-connector-edge-case
#   determinism  tests/gpu/vllm/test_determinism_matrix.py (tiny Llama and tiny hybrid) once per backend in
#                PDSERVE_PROOF_BACKENDS (default: FLASHINFER FLASH_ATTN TRITON_ATTN)
#   faithful     tests/gpu/vllm/test_kv_faithful_matrix.py (the break matrix of docs/faithful-kv.md) once per
#                backend in PDSERVE_PROOF_BACKENDS
#   vs-edge, vs-mamba, vs-multi
#                benchmarks/bench_bash_vs_plugin_gpu.py: vLLM's own run_*.sh script for that module, then the
#                plugin's command for it, timed side by side (versus.jsonl)
# A call has 600 s: the suites share PDSERVE_PROOF_DEADLINE seconds from this script's start (default 540), so a
# call always returns its logs; a suite cut short says so in summary.txt.
# vLLM's modules come from .cache/vllm-tests/<version>/nixl_integration (scripts/fetch-vllm-tests.sh VERSION, run
# where PyPI is reachable; carry ".cache/vllm-tests").
# Files written to OUT_DIR (flat, at most 8): machine.txt, summary.txt, suites.log.xz (every suite's output),
# evidence.jsonl (one line per determinism cell; for faithful, each measured distance and each control's verdict),
# versus.jsonl, gpu-memory.csv (nvidia-smi every second),
# server-logs.tar.xz (every server's log, the FLASHINFER JIT's build logs).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
t_start=$SECONDS
out=${1:-${OUT:-/tmp/gpu-proof}}
mkdir -p "$out"
suites=${PDSERVE_PROOF_SUITES:-examples contract edge mamba multi determinism faithful}
backends=${PDSERVE_PROOF_BACKENDS:-FLASHINFER FLASH_ATTN TRITON_ATTN}
per_suite=${PDSERVE_PROOF_TIMEOUT:-540}
deadline=${PDSERVE_PROOF_DEADLINE:-540}
for s in $suites; do
  case $s in examples|contract|edge|mamba|multi|determinism|faithful|vs-edge|vs-mamba|vs-multi) ;; *)
    echo "gpu-proof: unknown suite '$s' in PDSERVE_PROOF_SUITES (examples contract edge mamba multi determinism faithful vs-edge vs-mamba vs-multi)" >&2
    exit 2;; esac
done
for b in $backends; do
  case $b in FLASHINFER|FLASH_ATTN|TRITON_ATTN) ;; *)
    echo "gpu-proof: unknown backend '$b' in PDSERVE_PROOF_BACKENDS (FLASHINFER FLASH_ATTN TRITON_ATTN)" >&2; exit 2;; esac
done

bash scripts/gpu-vllm-cuda.sh install || exit $?
vllm=$(bash scripts/gpu-vllm-cuda.sh path)
py=$(dirname "$vllm")/python
stage=${PDSERVE_VLLM_CUDA_STAGE:-/tmp/pdserve-vllm-cuda}
logs=$stage/logs/$(date -u +%H%M%S)
mkdir -p "$logs"
# Greedy sampling never needs flashinfer's sampler, and its kernels would be JIT-compiled too: vLLM 0.26 takes it
# when flashinfer is importable unless told not to. FLASHINFER's attention kernels are JIT-compiled with the
# image's nvcc at a server's first start; their cache lives in the stage directory, so later calls on the same
# machine load them (FLASHINFER_WORKSPACE_BASE: flashinfer keeps <base>/.cache/flashinfer/<version>/<arch>/).
# NVLink multicast stays off on the lent machines (the device tool's KINDS.md says why).
export PDSERVE_VLLM_EXECUTABLE=$vllm VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  PDSERVE_CACHE_DIR=$stage/cache FLASHINFER_WORKSPACE_BASE=$stage/cache PDSERVE_GPU_PROOF_DIR=$out \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset CUDA_VISIBLE_DEVICES PDSERVE_SIMULATE_GPUS PDSERVE_PLATFORM PDSERVE_ENGINE ATTENTION_BACKEND VLLM_SERVE_EXTRA_ARGS
version=$("$py" -c 'import importlib.metadata as m; print(m.version("vllm"))')
mods=$repo/.cache/vllm-tests/$version/nixl_integration
jit=$stage/cache/.cache/flashinfer

{
  echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname) kernel $(uname -r) cpus $(nproc)"
  echo "--- nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total,memory.used"
  nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total,memory.used --format=csv,noheader
  "$py" -c 'import sys, torch, vllm, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "vllm", vllm.__version__, "transformers", transformers.__version__)'
  "$py" -m pip list 2>/dev/null | grep -Ei '^(nixl|nixl-cu13|pytest|pytest-pdserve|triton|tokenizers|flashinfer-python|apache-tvm-ffi) '
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -2 | xargs || echo 'not on PATH')"
  echo "flashinfer JIT cache before this call: $(find "$jit" -name '*.so' 2>/dev/null | wc -l) modules"
  echo "suites: $suites; backends: $backends"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 1000 >>"$out/gpu-memory.csv" 2>&1 &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT

base=(-p no:cacheprovider -v -rA --durations=0 --pd-share-gpus --pd-startup-timeout=420 "--pd-log-dir=$logs")
common=("${base[@]}" --pd-engine=vllm)
left() { echo $(( deadline - (SECONDS - t_start) - 20 )); }  # 20 s to gather the logs
run_suite() {  # name, then the pytest command's arguments; runs from the directory in $where
  local name=$1; shift
  local t0=$SECONDS rc limit
  limit=$(left); (( limit > per_suite )) && limit=$per_suite
  if (( limit < 60 )); then
    echo "$name: not run, $limit s left of the call's PDSERVE_PROOF_DEADLINE=$deadline" | tee -a "$out/summary.txt"; return 0
  fi
  echo "=== $name: pytest $* (in $where; limit $limit s)" | tee -a "$out/$name.log"
  (cd "$where" && timeout "$limit" "$py" -m pytest "$@") >>"$out/$name.log" 2>&1
  rc=$?
  local line
  line=$(grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$out/$name.log" | tail -1)
  echo "$name: exit $rc after $((SECONDS - t0)) s: ${line:-no pytest summary (cut at $limit s?)}" | tee -a "$out/summary.txt"
  grep -E "^pdserve: cluster .* ready in|^faithful-kv |PASSED|FAILED|SKIPPED|ERROR" "$out/$name.log" | head -90 >>"$out/summary.txt"
  return 0
}
module_suite() {  # name, module file, preset
  [ -f "$mods/$2" ] || { echo "$1: $mods/$2 missing (scripts/fetch-vllm-tests.sh $version, carry .cache/vllm-tests)" \
    | tee -a "$out/summary.txt"; return 0; }
  where=$mods run_suite "$1" "$2" --pd-export-env "--pd-preset=$3" "${common[@]}"
}
versus() {  # module: vLLM's script for it, then the plugin's command, on this GPU
  local limit
  limit=$(left)
  if (( limit < 120 )); then echo "vs-$1: not run, $limit s left" | tee -a "$out/summary.txt"; return 0; fi
  echo "=== vs-$1 (limit $limit s)" | tee -a "$out/vs-$1.log"
  timeout "$limit" "$py" benchmarks/bench_bash_vs_plugin_gpu.py "$1" --vllm "$vllm" --modules "$mods" \
    --work "$stage/versus" --logs "$logs/vs-$1" --record "$out/versus.jsonl" --budget "$((limit - 10))" \
    >>"$out/vs-$1.log" 2>&1
  echo "vs-$1: exit $?" | tee -a "$out/summary.txt"
  sed -n '/^| /p' "$out/vs-$1.log" >>"$out/summary.txt"
}
# vLLM 0.26 refuses the cross-layer LBHNC and its own script sets HND; 0.32 accepts LBHNC. Releases in between
# were not checked, so they get HND too (presets._layout says why).
layout=$("$py" -c 'import vllm; v = tuple(int(x) for x in vllm.__version__.split(".")[:2]); print("HND" if v < (0, 32) else "")')

for s in $suites; do
  case $s in
    # One GPU holds one real cluster at a time: the mamba example's hybrid cluster goes last, so `pd` is started
    # once instead of twice (each real start is 100-180 s). PDSERVE_PROOF_EXAMPLES_ORDER=file keeps file order,
    # which proves the stop and fresh restart of `pd` instead.
    examples)
      if [ "${PDSERVE_PROOF_EXAMPLES_ORDER:-grouped}" = file ]; then ex=(examples)
      else ex=($(cd "$repo" && ls examples/test_*.py | grep -v mamba) examples/rocm examples/test_mamba_prefix_cache.py); fi
      where=$repo run_suite examples "${ex[@]}" "${common[@]}" ;;
    contract) where=$repo run_suite contract tests/sim/test_contract.py "${base[@]}" ;;
    edge) module_suite edge test_edge_cases.py vllm-edge-case ;;
    # The script's FLASHINFER, as CI runs it; its 0.8 memory fraction twice does not fit one GPU, so the variable
    # the script honours sets 0.4, as a CI job would.
    mamba) GPU_MEMORY_UTILIZATION=0.4 module_suite mamba test_mamba_prefix_cache.py vllm-mamba-prefix-cache ;;
    multi) VLLM_KV_CACHE_LAYOUT=$layout module_suite multi test_multi_connector_edge_cases.py vllm-multi-connector-edge-case ;;
    determinism)
      for backend in $backends; do
        where=$repo ATTENTION_BACKEND=$backend run_suite "determinism-$backend" tests/gpu/vllm/test_determinism_matrix.py \
          "${common[@]}"
      done ;;
    vs-edge|vs-mamba) versus "${s#vs-}" ;;
    vs-multi) VLLM_KV_CACHE_LAYOUT=$layout versus multi ;;
    faithful)
      for backend in $backends; do
        where=$repo ATTENTION_BACKEND=$backend run_suite "faithful-$backend" tests/gpu/vllm/test_kv_faithful_matrix.py \
          "${common[@]}" -s
      done ;;
  esac
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader >"$out/apps-after.txt" 2>&1
{
  echo "compute apps after the run: $(xargs <"$out/apps-after.txt")"
  echo "GPU memory peak: $(cut -d, -f2 "$out/gpu-memory.csv" | grep -oE '[0-9]+' | sort -n | tail -1) MiB"
  # The FLASHINFER JIT: every module it built on this machine, and each compile step's time (ninja's log:
  # start and end in ms of every object file).
  echo "flashinfer JIT cache: $(find "$jit" -name '*.so' 2>/dev/null | wc -l) modules"
  for log in $(find "$jit" -name .ninja_log 2>/dev/null); do
    awk -v m="$(basename "$(dirname "$log")")" '!/^#/ {n++; s += ($2 - $1); if ($2 > e) e = $2; if (b == "" || $1 < b) b = $1}
      END {printf "  %s: %d steps, %.1f s of compile, %.1f s from first to last\n", m, n, s / 1000, (e - b) / 1000}' "$log"
  done
  echo "call: $((SECONDS - t_start)) s"
} | tee -a "$out/summary.txt"
rm -f "$out/apps-after.txt"
# At most 8 files come back: every suite log in one, every server log and the JIT build logs in one tarball.
for f in "$out"/*.log; do { echo "##### $(basename "$f")"; cat "$f"; } >>"$out/suites.log.tmp"; rm -f "$f"; done
[ -f "$out/suites.log.tmp" ] && mv "$out/suites.log.tmp" "$out/suites.log" && xz -9 -f "$out/suites.log"
tar -cJf "$out/server-logs.tar.xz" -C "$stage" "logs/$(basename "$logs")" \
  $(cd "$stage" && find cache/.cache/flashinfer \( -name .ninja_log -o -name '*.log' \) 2>/dev/null) 2>/dev/null || true
