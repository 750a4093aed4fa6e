#!/usr/bin/env bash
# Run tests/gpu on real GPUs, in one command, and keep the evidence (docs/hardware.md records the results).
#
#   scripts/gpu-proof.sh [--fake] [OUT_DIR]
#   scripts/gpu-proof.sh --engine=vllm [OUT_DIR]     real vLLM (CUDA): scripts/gpu-proof-vllm.sh says what it runs
#
# OUT_DIR defaults to $OUT (the device machine's result folder) or /tmp/gpu-proof. On the device (torch
# present, no PyPI) it makes a venv with --system-site-packages (for torch) and installs this checkout
# offline from .gpu-wheels/ (pure-python wheels downloaded beforehand, see docs/hardware.md). --fake
# rehearses everything on a machine without GPUs: tests/gpu/fake puts a stand-in nvidia-smi on PATH and a
# stand-in torch on PYTHONPATH (FAKE_GPU_COUNT GPUs, default 2).
#
# Files written (at most 8, flat, so they all come back from the device): machine.txt, pytest.log,
# evidence.jsonl, inner-runs.log, logs.tar.gz, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

fake=0
case "${1:-}" in
  --engine=vllm) shift; exec bash scripts/gpu-proof-vllm.sh "$@" ;;
  --engine=sim) shift ;;
  --engine=*) echo "gpu-proof: --engine takes sim or vllm, got '${1#--engine=}'" >&2; exit 2 ;;
esac
if [[ "${1:-}" == "--fake" ]]; then fake=1; shift; fi
out=${1:-${OUT:-/tmp/gpu-proof}}
mkdir -p "$out"
work=$(mktemp -d /tmp/gpu-proof-work.XXXXXX)
export PDSERVE_GPU_PROOF_DIR=$work/proof PYTHONUNBUFFERED=1
# Never let a stray caller setting change what the tests see.
unset CUDA_VISIBLE_DEVICES PDSERVE_SIMULATE_GPUS PDSERVE_PLATFORM PDSERVE_ENGINE

if (( fake )); then
  export PATH=$repo/tests/gpu/fake/bin:$PATH PYTHONPATH=$repo/tests/gpu/fake${PYTHONPATH:+:$PYTHONPATH}
  export FAKE_GPU_DIR=$work/fake-gpu FAKE_GPU_COUNT=${FAKE_GPU_COUNT:-2}
fi

t0=$(date +%s%N)
venv=$work/venv
base_python=${PDSERVE_PROOF_PYTHON:-python3}
{
  "$base_python" -m venv --system-site-packages "$venv" &&
  # The device's python3 is itself a venv (/opt/torch/.venv): --system-site-packages would reach the base
  # interpreter, not torch, so a .pth file adds the base python's own site-packages (after ours).
  "$base_python" -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/zz-base-python.pth" &&
  "$venv/bin/python" -m pip install -q --no-index --find-links .gpu-wheels "setuptools>=69" wheel &&
  "$venv/bin/python" -m pip install -q --no-index --find-links .gpu-wheels --no-build-isolation -e .
} >"$out/install.log" 2>&1 || { echo "gpu-proof: offline install failed:"; tail -30 "$out/install.log"; exit 3; }
py=$venv/bin/python
t_install=$(date +%s%N)

{
  echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname) kernel $(uname -r) cpus $(nproc)"
  echo "mode: $([[ $fake == 1 ]] && echo 'FAKE (tests/gpu/fake stand-ins)' || echo 'real GPUs')"
  echo "install_seconds: $(( (t_install - t0) / 1000000 ))e-3"
  echo "--- nvidia-smi -L"; nvidia-smi -L
  echo "--- nvidia-smi --query-gpu=index,uuid --format=csv,noheader"; nvidia-smi --query-gpu=index,uuid --format=csv,noheader
  echo "--- nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used --format=csv,noheader,nounits"
  nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used --format=csv,noheader,nounits
  echo "--- compute apps before"; nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits
  echo "--- python"
  "$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda devices", torch.cuda.device_count())'
  "$py" -m pip list 2>/dev/null | grep -Ei '^(pytest|pytest-xdist|pytest-timeout|httpx|starlette|uvicorn|filelock|prometheus.client|pytest-pdserve) '
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

set +e
timeout "${PDSERVE_PROOF_TIMEOUT:-420}" "$py" -m pytest tests/gpu -v -rA -p no:cacheprovider --durations=0 --timeout=300 \
  2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
set -e
t_end=$(date +%s%N)

nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits >"$work/apps-after.txt" 2>&1
proof=$PDSERVE_GPU_PROOF_DIR
cp "$proof/evidence.jsonl" "$out/" 2>/dev/null || true
cp "$proof/inner-runs.log" "$out/" 2>/dev/null || true
tar czf "$out/logs.tar.gz" -C "$proof" logs 2>/dev/null || true
"$py" - "$out" "$rc" "$(( (t_end - t_install) / 1000000 ))e-3" "$work/apps-after.txt" <<'EOF' | tee "$out/summary.txt"
import json, sys, time
from pathlib import Path

out, rc, seconds, after = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
print(f"gpu-proof: pytest exit {rc}, tests took {float(seconds):.1f}s")
print("compute apps after the run:", after.read_text().strip() or "none")
ev = out / "evidence.jsonl"
for line in ev.read_text().splitlines() if ev.exists() else []:
    rec = json.loads(line)
    name = rec.pop("test").split("::")[-1]
    keep = {k: v for k, v in rec.items() if k not in ("servers", "samples", "nvidia_smi", "compute_apps", "clusters",
                                                      "busy_poll_sample", "overlap_apps", "by_worker")}
    print(f"- {name}: {json.dumps(keep)}")
    for s in rec.get("servers", []) or rec.get("shared", []):
        print(f"    {s['name']}: token {s['handle_gpus']} -> {s['uuid']} pid {s['pid']}")
    for w, servers in (rec.get("by_worker") or {}).items():
        for s in servers:
            print(f"    {w} {s['name']}: token {s['handle_gpus']} -> {s['uuid']} pid {s['pid']}")
    for w, c in (rec.get("clusters") or {}).items():
        for s in c["servers"]:
            print(f"    {w} {s['name']}: token {s['handle_gpus']} -> {s['uuid']} pid {s['pid']}")
        at = lambda t: time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
        print(f"    {w}: ready at {at(c['ready_wall'])} (start {c['started_seconds']:.1f}s), overlap check at {at(c['overlap_wall'])}")
EOF
rm -rf "$work"
exit "$rc"
