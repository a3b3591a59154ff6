#!/usr/bin/env bash
# The checks worth a GPU lent for minutes, the most telling first, each under its own time
# limit so that a slow one cannot eat the rest: the CUDA integration tests, the unit test files
# that touch CUDA, bench.decode (which keeps decode.partial.gpu.json after every case) and
# bench.scale --quick.
#
#   bench/gpu.sh [LOGDIR]        (default /tmp/tierkv-gpu; PYTHON picks the interpreter)
#
# Limits in seconds, 0 skipping the check: T_TESTS (150), T_UNIT (60), T_DECODE (300), T_SCALE
# (120). Each check's output goes to LOGDIR/<check>.log, its last lines and exit status to
# stdout; the GPU result files are copied to LOGDIR. Exits 2 where torch sees no CUDA device.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${1:-/tmp/tierkv-gpu}
mkdir -p "$LOGS"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)'
case $? in
    0) ;;
    2) echo "bench/gpu.sh: torch sees no CUDA device here: nothing to check" >&2; exit 2 ;;
    *) echo "bench/gpu.sh: $PY could not import torch" >&2; exit 1 ;;
esac
"$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'

check() {
    local name=$1 limit=$2 start rc
    shift 2
    if [ "$limit" = 0 ]; then echo "== $name: skipped (its limit is 0)"; return; fi
    echo "== $name (at most $limit s): $*"
    start=$(date +%s)
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    echo "   exit $rc after $(( $(date +%s) - start )) s$([ $rc = 124 ] && echo ' (time limit)')"
    grep -v 'it/s\]' "$LOGS/$name.log" | tail -n 6 | sed 's/^/   /'
}

check cuda-tests "${T_TESTS:-150}" "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_cuda.py
# The unit test files that mention CUDA (pinned host tier, side streams, a device tier on the GPU)
check cuda-unit "${T_UNIT:-60}" "$PY" -m pytest -q -p no:cacheprovider $(grep -l cuda tests/test_*.py)
check decode "${T_DECODE:-300}" "$PY" -m bench.decode
check scale "${T_SCALE:-120}" "$PY" -m bench.scale --quick
cp bench/results/*.gpu.json "$LOGS"/ 2>/dev/null
echo "logs and result files in $LOGS"
