#!/usr/bin/env bash
# Run a command beside HOGS busy processes (default 3: on 2 cores, as loaded as CI's machine can be), to see a
# test's verdict on a slow machine before CI does. Each busy loop runs in a session of its own: the kernel's
# autogroup scheduling gives each session a fair share, so loops in this script's own session would barely slow
# a command whose servers start sessions of their own. The loops end with the command; its exit status is kept.
#
#   scripts/under-load.sh [-n HOGS] COMMAND...
#   scripts/under-load.sh .venv/bin/python -m pytest -p no:cacheprovider tests/glue/test_lifecycle.py
set -u
hogs=3
if [ "${1:-}" = -n ]; then
    hogs=${2:-}
    shift 2 || true
fi
case $hogs in '' | *[!0-9]*) echo "under-load: -n wants a number of busy processes, not '$hogs'" >&2; exit 2 ;; esac
[ $# -gt 0 ] || { echo "usage: scripts/under-load.sh [-n HOGS] COMMAND..." >&2; exit 2; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT INT TERM
for _ in $(seq "$hogs"); do
    # "under-load-hog-<this script's pid>" names the loop (its $0): whoever looks can tell it from anyone else's.
    (exec setsid bash -c 'end=$((SECONDS + 7200)); while [ "$SECONDS" -lt "$end" ]; do :; done' "under-load-hog-$$") &
    pids+=($!)
done
"$@"
