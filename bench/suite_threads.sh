#!/usr/bin/env bash
# The suite's OpenMP threads per pytest-xdist worker (issue 24): the in-process kernel and model
# tests under two workers with 2 threads each (torch's default on 2 cores) against 1 each
# (tests/conftest.py's choice), alternating A B A B in one run. Usage: bench/suite_threads.sh [FILES...]
set -euo pipefail
cd "$(dirname "$0")/.."
FILES=${*:-tests/kernels/test_paged_attention.py tests/kernels/test_moe_experts.py tests/models/test_decode_layer.py}
echo "command: bench/suite_threads.sh $FILES  ($(date -u +%FT%TZ), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores)"
for t in 2 1 2 1; do
  s=$(date +%s.%N)
  OMP_NUM_THREADS=$t .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile $FILES >/tmp/suite_threads_$t.log 2>&1 || true
  e=$(date +%s.%N)
  echo "OMP_NUM_THREADS=$t: $(echo "$e - $s" | bc) s wall; $(grep -E 'passed|failed' /tmp/suite_threads_$t.log | tail -1)"
done
