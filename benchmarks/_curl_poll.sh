#!/usr/bin/env bash
# vLLM's bash P/D scripts' readiness loop (run_accuracy_test.sh style wait_for_server), re-implemented:
# GET /v1/completions with curl (no -f: any HTTP answer, even 405, ends the loop), sleep 1 between tries.
# Usage: _curl_poll.sh PORT OUT ; writes the wall-clock time (date +%s.%N) of the successful curl to OUT.
port=$1
out=$2
timeout 120 bash -c "
  until curl -s localhost:${port}/v1/completions > /dev/null; do
    sleep 1
  done" || exit 1
date +%s.%N > "$out"
