#!/usr/bin/env bash
# Pack real vLLM (CUDA) for a GPU machine that has torch but no package index (the lent H200s).
#
#   scripts/pack-vllm-cuda.sh [OUT_DIR]        (default .gpu-vllm/, gitignored)
#
# Writes OUT_DIR/vllm-cuda.tar.xz.partNN, OUT_DIR/SHA256SUMS and OUT_DIR/MANIFEST (vLLM version, the torch it pins,
# the xz level, sizes). The parts are as few as PDSERVE_PACK_PART_MAX bytes each allow (default 55,000,000) and of
# equal size: a device call carries at most 64 MiB (67,108,864 bytes) with the checkout, so each part leaves 12 MB
# for the checkout and whatever else a call carries, and a pack a few MB larger than the last one still stages in
# as many calls (MANIFEST's parts= says how many). scripts/gpu-proof.sh --engine=vllm joins and verifies them on
# the device, checks the torch pin against the device's torch, and installs offline.
#
# The wheels are constraints/vllm-cuda.txt: every package vLLM needs that the device image lacks, exact versions
# (scripts/lock-vllm-cuda.sh refreshes it from vLLM's metadata without downloading vLLM). Pruned after install,
# each for a reason written below; what is left unpacks to ~660 MB.
#
# Compression: PDSERVE_PACK_XZ_LEVEL (default 1). Measured on the shared 2 cores (docs/hardware.md): xz -1 packed
# 155 MB in 11 minutes at a load average of 25-30, where -6 wrote about 1 MB a minute (it would have taken two hours
# for ~140 MB, the same three parts); on a quiet machine -6 takes ~4 minutes. Both unpack in seconds on the device.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$repo/.gpu-vllm}
level=${PDSERVE_PACK_XZ_LEVEL:-1}
part_max=${PDSERVE_PACK_PART_MAX:-55000000}
lock=$repo/constraints/vllm-cuda.txt
case $level in [0-9]) ;; *) echo "pack-vllm-cuda: PDSERVE_PACK_XZ_LEVEL must be one digit 0-9, got '$level'" >&2; exit 2;; esac
case $part_max in ''|*[!0-9]*) echo "pack-vllm-cuda: PDSERVE_PACK_PART_MAX must be ASCII digits, got '$part_max'" >&2; exit 2;; esac
[ -f "$lock" ] || { echo "pack-vllm-cuda: $lock is missing (scripts/lock-vllm-cuda.sh writes it)" >&2; exit 2; }
command -v xz >/dev/null || { echo "pack-vllm-cuda: needs xz (apt-get install xz-utils)" >&2; exit 2; }

work=${PDSERVE_PACK_WORK:-$(mktemp -d /tmp/pack-vllm-cuda.XXXXXX)}
[ -n "${PDSERVE_PACK_WORK:-}" ] || trap 'rm -rf "$work"' EXIT
# The device's interpreter: CPython 3.12 on x86-64 glibc (docs/hardware.md).
target=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all:
        --platform any --platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 39); do target+=(--platform "manylinux_2_${n}_x86_64"); done

t0=$SECONDS
python3 -m pip download -q --no-deps "${target[@]}" -d "$work/wheels" -r "$lock"
echo "pack-vllm-cuda: $(ls "$work/wheels" | wc -l) wheels, $(du -sm "$work/wheels" | cut -f1) MB, after $((SECONDS - t0)) s"
rm -rf "$work/site"
python3 -m pip install -q --no-deps --no-compile --no-index --target "$work/site" "${target[@]}" "$work/wheels"/*.whl
site=$work/site
# Pruned (each is large and unused on an H100/H200 with this project's tiny models):
#  - nixl_ep and nixl_ep_cu13: NIXL's expert-parallel kernels and their dispatcher; NixlConnector uses the
#    nixl_cu13 agent only. Both go: with the dispatcher alone, vLLM's has_nixl_ep() imports it at every start and
#    logs "Module nixl_ep was found but failed to import" with an ImportError's traceback.
#  - vllm_flash_attn/_vllm_fa2_C: FlashAttention 2; on SM90 vLLM picks FA3 (_vllm_fa3_C stays).
#  - _moe_C_stable_libtorch: fused-MoE ops; the tiny Llama and the tiny NemotronH have no experts.
#  - vllm-rs: a Rust front-end binary that `vllm serve` does not start.
rm -rf "$site/nixl_ep" "$site/nixl_ep_cu13" "$site"/nixl_ep_cu13* "$site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" \
       "$site/vllm/_moe_C_stable_libtorch.abi3.so" "$site/vllm/vllm-rs"
find "$site" -name __pycache__ -prune -exec rm -rf {} +
unpacked_mb=$(du -sm "$site" | cut -f1)
vllm_version=$(sed -n 's/^vllm==//p' "$lock")
torch_pin=$(sed -n 's/^# torch-pin: //p' "$lock")
[ -n "$vllm_version" ] && [ -n "$torch_pin" ] || { echo "pack-vllm-cuda: $lock names no vllm==X or no '# torch-pin:' line" >&2; exit 2; }
printf '%s\n' "vllm=$vllm_version" "torch=$torch_pin" >"$site/.pdserve-vllm-cuda"

mkdir -p "$out"
rm -f "$out"/vllm-cuda.tar.xz.part* "$out/SHA256SUMS" "$out/MANIFEST"
t1=$SECONDS
tar -C "$site" -cf - . | xz "-$level" -T2 -c >"$work/vllm-cuda.tar.xz"
xz_s=$((SECONDS - t1))
packed=$(stat -c %s "$work/vllm-cuda.tar.xz")
nparts=$(( (packed + part_max - 1) / part_max ))
split -n "$nparts" -d -a 2 "$work/vllm-cuda.tar.xz" "$out/vllm-cuda.tar.xz.part"
(cd "$out" && sha256sum vllm-cuda.tar.xz.part* >SHA256SUMS)
{
  echo "vllm=$vllm_version"
  echo "torch=$torch_pin"
  echo "xz_level=$level"
  echo "unpacked_mb=$unpacked_mb"
  echo "packed_bytes=$packed"
  echo "xz_seconds=$xz_s"
  echo "parts=$nparts"
  echo "part_bytes=$(stat -c %s "$out/vllm-cuda.tar.xz.part00")"
  echo "packed_utc=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$out/MANIFEST"
cat "$out/MANIFEST"
echo "pack-vllm-cuda: done after $((SECONDS - t0)) s: $(ls "$out"/vllm-cuda.tar.xz.part* | xargs -n1 basename | xargs)"
