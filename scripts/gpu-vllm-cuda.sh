#!/usr/bin/env bash
# Device side of real vLLM (CUDA): stage the packed parts a device call carried, then install them offline.
#
#   scripts/gpu-vllm-cuda.sh stage     move every .gpu-vllm/vllm-cuda.tar.xz.partNN this call carried (with
#                                      SHA256SUMS and MANIFEST) into the stage directory; say which are missing
#   scripts/gpu-vllm-cuda.sh install   all parts staged: verify each checksum, check the torch pin against this
#                                      machine's torch, unpack into a venv over the image's python3, write its
#                                      `vllm` script, install this checkout into it (all offline); idempotent
#   scripts/gpu-vllm-cuda.sh path      print the venv's vllm executable (exit 1 if not installed)
#
# The parts come from scripts/pack-vllm-cuda.sh (on a machine with PyPI). A device call carries at most 64 MiB,
# so each call carries one part (`carry: [".gpu-vllm/vllm-cuda.tar.xz.part00", ".gpu-vllm/SHA256SUMS",
# ".gpu-vllm/MANIFEST"]`), and a warm machine keeps the stage directory between back-to-back calls.
# PDSERVE_VLLM_CUDA_STAGE: the stage directory (default /tmp/pdserve-vllm-cuda; it holds the venv too).
#
# Exit codes: 0 done; 2 bad use; 3 a part or checksum is missing or wrong; 4 torch mismatch; 5 install failed.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
carried=$repo/.gpu-vllm
stage=${PDSERVE_VLLM_CUDA_STAGE:-/tmp/pdserve-vllm-cuda}
venv=$stage/venv
base_python=${PDSERVE_PROOF_PYTHON:-python3}
say() { echo "gpu-vllm-cuda: $*"; }
die() { code=$1; shift; echo "gpu-vllm-cuda: ERROR: $*" >&2; exit "$code"; }
manifest_value() { sed -n "s/^$1=//p" "$stage/MANIFEST"; }

stage_parts() {
  mkdir -p "$stage/parts"
  for meta in SHA256SUMS MANIFEST; do
    if [ -f "$carried/$meta" ]; then
      # A part from another pack must not be mixed with these: a new MANIFEST drops what was staged before.
      if [ "$meta" = MANIFEST ] && [ -f "$stage/MANIFEST" ] && ! cmp -s "$carried/MANIFEST" "$stage/MANIFEST"; then
        say "a new pack (MANIFEST differs): dropping the parts staged before"; rm -rf "$stage/parts" "$stage/installed"
        mkdir -p "$stage/parts"
      fi
      cp "$carried/$meta" "$stage/$meta"
    fi
  done
  [ -f "$stage/MANIFEST" ] && [ -f "$stage/SHA256SUMS" ] \
    || die 3 "no MANIFEST/SHA256SUMS staged: carry .gpu-vllm/MANIFEST and .gpu-vllm/SHA256SUMS with a part"
  shopt -s nullglob
  for part in "$carried"/vllm-cuda.tar.xz.part*; do
    name=$(basename "$part")
    want=$(awk -v n="$name" '$2 == n {print $1}' "$stage/SHA256SUMS")
    [ -n "$want" ] || die 3 "$name is not listed in SHA256SUMS (a part of another pack?)"
    got=$(sha256sum "$part" | cut -d' ' -f1)
    [ "$got" = "$want" ] || die 3 "$name: sha256 $got, SHA256SUMS says $want (a truncated transfer?)"
    mv -f "$part" "$stage/parts/$name"
    say "staged $name ($(stat -c %s "$stage/parts/$name") bytes, checksum ok)"
  done
  missing=()
  while read -r _ name; do [ -f "$stage/parts/$name" ] || missing+=("$name"); done <"$stage/SHA256SUMS"
  total=$(wc -l <"$stage/SHA256SUMS")
  if [ ${#missing[@]} -gt 0 ]; then
    say "$((total - ${#missing[@]})) of $total parts staged; still to carry: ${missing[*]}"
    return 1
  fi
  say "all $total parts staged in $stage/parts"
}

launcher() {  # NAME MODULE: a console script for the venv's python, as pip writes one
  # The __main__ guard matters: vLLM starts its engine core with multiprocessing's spawn, which imports the
  # parent's __main__ again; without the guard the child runs `vllm serve` once more and dies at bootstrap.
  printf '#!%s\nimport sys\nfrom %s import main\nif __name__ == "__main__":\n    sys.exit(main())\n' \
    "$venv/bin/python" "$2" >"$venv/bin/$1"
  chmod +x "$venv/bin/$1"
}

install() {
  if [ -f "$stage/installed" ] && [ -x "$venv/bin/vllm" ] && cmp -s "$stage/installed" "$stage/MANIFEST"; then
    launcher vllm vllm.entrypoints.cli.main
    say "already installed: $venv/bin/vllm"; return 0
  fi
  stage_parts || die 3 "cannot install before every part is staged"
  (cd "$stage/parts" && sha256sum -c --quiet "$stage/SHA256SUMS") || die 3 "a staged part fails its checksum"
  local torch_pin have
  torch_pin=$(manifest_value torch)
  have=$("$base_python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null) \
    || die 4 "$base_python cannot import torch: the pack needs the image's torch $torch_pin"
  [ "$have" = "$torch_pin" ] || die 4 "vLLM $(manifest_value vllm) pins torch $torch_pin, this machine has torch $have: \
pack a vLLM that pins $have (scripts/lock-vllm-cuda.sh refuses the others)"
  rm -rf "$venv"
  "$base_python" -m venv --system-site-packages "$venv" || die 5 "venv failed"
  local site
  site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  # The image's python3 is itself a venv: --system-site-packages reaches the base interpreter, not torch, so a
  # .pth adds the image's own site-packages, after ours (vLLM's pinned packages win over the image's).
  "$base_python" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/zz-base-python.pth"
  local t0=$SECONDS
  cat "$stage/parts"/vllm-cuda.tar.xz.part* | xz -dc -T0 | tar -x -C "$site" || die 5 "unpacking failed"
  # pip --target wrote console scripts for the packing machine's python: ours point at the venv's.
  rm -rf "$site/bin"
  launcher vllm vllm.entrypoints.cli.main
  say "unpacked $(manifest_value unpacked_mb) MB in $((SECONDS - t0)) s"
  # The plugin, offline (vLLM's pack brings its starlette/uvicorn/httptools/sniffio; the image has the rest).
  # pip needs setuptools >= 77 for pyproject's license expression; an image with an older one gets what an
  # editable install writes: the checkout on sys.path and the plugin's entry points.
  if ! "$venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e "$repo" >"$stage/pip.log" 2>&1; then
    say "pip could not install the checkout ($(grep -m1 -oE '[A-Za-z]+Error: .{0,80}' "$stage/pip.log" || echo see $stage/pip.log)); writing its entry points by hand"
    local version dist
    version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)
    dist=$site/pytest_pdserve-$version.dist-info
    mkdir -p "$dist"
    echo "$repo" >"$site/pytest_pdserve_checkout.pth"
    printf 'Metadata-Version: 2.1\nName: pytest-pdserve\nVersion: %s\n' "$version" >"$dist/METADATA"
    printf '[pytest11]\npdserve = pytest_pdserve.plugin\n\n[console_scripts]\npdserve = pytest_pdserve.cli:main\npdserve-sim = pytest_pdserve.sim.__main__:main\n' \
      >"$dist/entry_points.txt"
    printf 'installer\n' >"$dist/INSTALLER"; : >"$dist/RECORD"
    launcher pdserve pytest_pdserve.cli
    launcher pdserve-sim pytest_pdserve.sim.__main__
  fi
  "$venv/bin/python" -c 'import vllm, pytest_pdserve, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' \
    || die 5 "the installed venv cannot import vllm"
  cp "$stage/MANIFEST" "$stage/installed"
  say "installed: $venv/bin/vllm"
}

case ${1:-} in
  stage) stage_parts || exit 0 ;;  # not every part yet is a normal step between calls
  install) install ;;
  path) [ -x "$venv/bin/vllm" ] && echo "$venv/bin/vllm" || exit 1 ;;
  *) echo "usage: $0 stage|install|path" >&2; exit 2 ;;
esac
