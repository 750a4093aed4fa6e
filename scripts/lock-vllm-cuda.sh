#!/usr/bin/env bash
# Refresh constraints/vllm-cuda.txt: the exact wheels real vLLM (CUDA) needs on the lent GPU image, from vLLM's
# metadata alone (pip's resolver in --dry-run mode reads each wheel's metadata; vLLM's 400+ MB wheel is not
# downloaded).
#
#   scripts/lock-vllm-cuda.sh [VLLM_VERSION] [NIXL_VERSION] [UPLOADED_PRIOR_TO]
#       defaults: the versions and the date in the current lock; PDSERVE_LOCK_UPGRADE=1 re-resolves every pin
#
# Reproducible, as pip-compile keeps a lock: the same vLLM and NIXL as the current lock resolve with the current
# pins as constraints (so the lock comes out the same, and only a package that is new gets a version), and a
# package that needs a version gets the newest one uploaded before UPLOADED_PRIOR_TO (pip's --uploaded-prior-to,
# pip >= 26.0; an older pip gets a newer one in a scratch venv). Without both, the unpinned dependencies of vLLM
# drift: 89 pins on 2026-12-05 where 87 were locked on 2026-12-02 (newer anthropic, openai, uvicorn, ...; and
# transformers' newest release brought `kernels`, which the image's transformers does not need: the image's
# versions are constraints too, constraints/h200-image.txt). Only the index counts: pip's config files
# (find-links, constraints) are not read, since local files carry no upload date; PIP_INDEX_URL still applies.
#
# Refuses a vLLM whose torch pin is not the image's torch (IMAGE_TORCH, default 2.11.0): vLLM pins torch exactly
# and the image's torch cannot be replaced there. Leaves out what the image has (constraints/h200-image.txt) and
# optional packages vLLM or flashinfer import lazily (OPTIONAL below).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
lock=$repo/constraints/vllm-cuda.txt
image=$repo/constraints/h200-image.txt
image_torch=${IMAGE_TORCH:-2.11.0}
vllm=${1:-$(sed -n 's/^vllm==//p' "$lock" 2>/dev/null)}
nixl=${2:-$(sed -n 's/^nixl==//p' "$lock" 2>/dev/null)}
at=${3:-$(sed -n 's/^# uploaded-prior-to: //p' "$lock" 2>/dev/null)}
[ -n "$vllm" ] && [ -n "$nixl" ] || { echo "usage: $0 VLLM_VERSION NIXL_VERSION [UPLOADED_PRIOR_TO] (no current lock to read them from)" >&2; exit 2; }
at=${at:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
[[ "$at" =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$ ]] \
  || { echo "lock-vllm-cuda: UPLOADED_PRIOR_TO must be a UTC time like 2026-12-03T00:00:00Z, got '$at'" >&2; exit 2; }
# Left out on purpose, each a kernel library, a CUDA toolchain piece or a tool that `vllm serve` of a tiny dense or
# hybrid model on SM90 does not import (the proof sets VLLM_USE_FLASHINFER_SAMPLER=0). flashinfer-python is kept
# (the FLASHINFER attention backend); its own cuda-tile, nvidia-cudnn-frontend and nvidia-cutlass-dsl are imported
# only by its cuDNN, CuTe-DSL and cuTile kernels (Blackwell GEMMs, MLA, the SSD kernel), never on the paged
# prefill/decode path vLLM's FLASHINFER backend takes on Hopper (docs/hardware.md, "FLASHINFER").
OPTIONAL='^(flashinfer-(cubin|jit-cache)|tokenspeed-.*|nvidia-cutlass-dsl.*|nvidia-cuda-(nvcc|cccl|crt|nvdisasm).*|nvidia-nvvm.*|nvidia-cudnn-frontend|cuda-python|cuda-tile|humming-kernels|quack-kernels|fastsafetensors|pyelftools|supervisor|torch-c-dlpack-ext|tilelang|nixl-cu12|pynvvideocodec|z3-solver|torchcodec|triton-kernels)$'
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
pip=(python3 -m pip)
if ! python3 -m pip install --help 2>/dev/null | grep -q -- --uploaded-prior-to; then
  python3 -m venv "$scratch/pip" && "$scratch/pip/bin/python" -m pip install -q 'pip>=26.0' \
    || { echo "lock-vllm-cuda: needs pip >= 26.0 (--uploaded-prior-to) and could not install it" >&2; exit 2; }
  pip=("$scratch/pip/bin/python" -m pip)
fi
target=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all:
        --platform any --platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 39); do target+=(--platform "manylinux_2_${n}_x86_64"); done
# Constraints: the image's versions where known (name==version lines of h200-image.txt), and the current pins
# unless a new vLLM/NIXL is asked for or PDSERVE_LOCK_UPGRADE=1.
grep -E '^[A-Za-z0-9._-]+==' "$image" >"$scratch/constraints.txt" || true
if [ "${PDSERVE_LOCK_UPGRADE:-0}" != 1 ] && [ -f "$lock" ] && grep -qx "vllm==$vllm" "$lock" && grep -qx "nixl==$nixl" "$lock"; then
  grep -E '^[A-Za-z0-9._-]+==' "$lock" >>"$scratch/constraints.txt"
fi
t0=$SECONDS
env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
  "${pip[@]}" install -q --dry-run --ignore-installed --report "$scratch/report.json" --target "$scratch/t" \
  --uploaded-prior-to "$at" -c "$scratch/constraints.txt" "${target[@]}" "vllm==$vllm" "nixl==$nixl" "nixl-cu13==$nixl"
python3 - "$scratch/report.json" "$image" "$image_torch" "$OPTIONAL" "$vllm" "$nixl" "$at" >"$scratch/lock" <<'PY'
import json, re, sys
report, image, image_torch, optional, vllm, nixl, at = sys.argv[1:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(l.split("==")[0].strip()) for l in open(image) if l.strip() and not l.startswith("#")}
pins = {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.load(open(report))["install"]}
torch = pins.get("torch")
if torch != image_torch:
    sys.exit(f"lock-vllm-cuda: vllm=={vllm} pins torch=={torch}; the H200 image has torch {image_torch}. "
             "Pick a vLLM release that pins the image's torch (0.20.0-0.26.0 pin 2.11.0).")
print("# Real vLLM (CUDA) for the lent GPU image: the wheels it lacks, exact versions.")
print("# Generated by scripts/lock-vllm-cuda.sh from vLLM's metadata; scripts/pack-vllm-cuda.sh packs them.")
print("# For CPython 3.12, manylinux x86-64. Re-locking keeps these pins; a package new to the lock gets the newest")
print("# version uploaded before:")
print(f"# uploaded-prior-to: {at}")
print(f"# torch-pin: {torch}")
kept = sorted(n for n in pins if n not in have and not re.match(optional, n))
for n in ["vllm", "nixl", "nixl-cu13"] + [n for n in kept if n not in ("vllm", "nixl", "nixl-cu13")]:
    print(f"{n}=={pins[n]}")
PY
mv "$scratch/lock" "$lock"
echo "lock-vllm-cuda: wrote $lock ($(grep -vc '^#' "$lock") pins, torch $image_torch, index as at $at) in $((SECONDS - t0)) s"
