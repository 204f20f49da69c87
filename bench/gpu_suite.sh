#!/usr/bin/env bash
# The GPU suite, from the repository root, on a machine with a CUDA GPU: the tests that need one
# (bench/gpu_tests.txt), then the two GPU benchmarks (bench/results/gpu-step-cuda.* and kernels-cuda.*). Each stage
# runs on if another fails, and the script exits non-zero if any did. Never timed on a GPU: a first run uses bench/gpu_first_run.sh (time-boxed,
# figures written as measured) instead; run a stage alone to split this one.
#
#     bash bench/gpu_suite.sh            # tests, then the benchmarks
#     bash bench/gpu_suite.sh tests      # the CUDA tests only
#     bash bench/gpu_suite.sh bench      # the benchmarks only
#
# LOG_DIR receives each stage's full output (default: $OUT, the folder a lent GPU host sends back, where it is set;
# else a temporary folder); where OUT is set, the benchmarks' results files are copied there too.
set -u -o pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-${OUT:-$(mktemp -d)}}
mkdir -p "$LOG_DIR"
PYTHON=${PYTHON:-python3}
stage=${1:-all}
failed=0

run() {  # name, command...
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    PYTHONUNBUFFERED=1 "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - start)) s (log: $LOG_DIR/$name.log)"
    [ "$rc" -eq 0 ] || failed=1
}

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible to torch')" || exit 2
if ! "$PYTHON" -c "import lookahead.kernels, lookahead.models" 2>/dev/null; then  # this checkout, installed offline
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . || exit 2
fi
if [ "$stage" = all ] || [ "$stage" = tests ]; then
    mapfile -t tests < <(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' bench/gpu_tests.txt)
    run tests "$PYTHON" -m pytest -q -p no:cacheprovider "${tests[@]}"
fi
if [ "$stage" = all ] || [ "$stage" = bench ]; then
    run gpu_step "$PYTHON" bench/gpu_step.py
    run bench_kernels "$PYTHON" bench/bench_kernels.py
    if [ -n "${OUT:-}" ]; then  # the results files too (bench/results/*-cuda.*), where only $OUT comes back
        cp bench/results/gpu-step-cuda.* bench/results/kernels-cuda.* "$OUT"/ 2>/dev/null
    fi
fi
exit $failed
