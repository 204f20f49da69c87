#!/usr/bin/env bash
# The first run on a GPU host: the most valuable figures first, each written as it is measured, the whole run
# stopping itself before its budget (default 540 s: one 10-minute call with room to spare). Needs only this checkout
# and torch + triton with CUDA (no model file, no network). From the repository root:
#
#     bash bench/gpu_first_run.sh                 # a CUDA host: parts a-e, about 9 minutes at most
#     bash bench/gpu_first_run.sh --dry-run       # a CPU: the same parts at tiny shapes, about half a minute (its
#                                                 # budgets stretch with the CPU's load)
#     bash bench/gpu_first_run.sh --budget 300 --parts "a b"
#
# Parts, in order of value, each in its own process (a CUDA error in one does not poison the next) under its own
# budget, cut to what the whole run has left (docs/gpu.md lists each part's expected time):
#   a  bench/first_run.py --part a: an 8B-shaped bf16 step, graphed, at every padded step size; plain on its own runner
#   b  bench/first_run.py --part b: tokens/s plain vs lookahead, SmolLM2-shaped, replaying steps recorded on a CPU
#   c  bench/first_run.py --part c: the engine at 1, 8 and 32 rows
#   d  bench/first_run.py --part d: the batch-invariant mode's tests and cost, where the checkout has it
#   e  the GPU tests (bench/gpu_tests.txt), last, with what time is left: those that use the GPU first (pytest
#      --gpu-first; the CPU's run in CI anyway), each test's outcome named (-rA), interrupted (SIGINT) at the budget so
#      that pytest still prints what ran
# OUT (default: bench/results/first-run-cuda, or -cpu) receives first-run.jsonl (one JSON object a line, flushed as
# measured; the script's own lines have "event") and first-run.log (every part's output). Exit 0 when every part
# that ran ended well, 1 otherwise, 2 when it could not start. The commit measured is git's where .git is there, and
# is written to bench/COMMIT; where it is not (a lent GPU host gets the files, not .git), bench/COMMIT is read.
set -u -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
dry=0 budget="" parts="a b c d e"
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry=1 ;;
        --budget) budget=${2:?--budget needs seconds}; shift ;;
        --parts) parts=${2:?--parts needs a list such as "a b"}; shift ;;
        -h | --help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
# seconds: the whole run, each part's, the least a part starts with, kept back at the end, and a part's grace: it
# stops itself at its budget (counted from its process's start, imports included) and is killed this much later
if [ "$dry" = 1 ]; then
    # a CPU's seconds stretch with its load: beside 8 busy processes on 2 cores a part's imports alone took 27 s of its
    # 25, so every figure is multiplied by the 1-minute load average per core, rounded up (DRY_RUN_STRETCH sets it)
    stretch=${DRY_RUN_STRETCH:-$(awk -v cores="$(nproc)" '{s = $1 / cores; print (s > int(s)) ? int(s) + 1 : int(s)}' \
        /proc/loadavg 2>/dev/null)}
    if [ -n "${DRY_RUN_STRETCH:-}" ] && ! [ "$DRY_RUN_STRETCH" -ge 1 ] 2>/dev/null; then
        echo "DRY_RUN_STRETCH=$DRY_RUN_STRETCH: give a whole number >= 1 (the factor for every budget), or unset it" >&2
        exit 2
    fi
    [ "${stretch:-0}" -ge 1 ] 2>/dev/null || stretch=1  # no /proc/loadavg: unstretched
    total=${budget:-$((90 * stretch))} reserve=2 least=$((3 * stretch)) grace=$((5 * stretch)) slug=cpu
    declare -A want=([a]=$((25 * stretch)) [b]=$((15 * stretch)) [c]=$((20 * stretch)) [d]=$((15 * stretch)) [e]=$total)
else
    total=${budget:-540} reserve=10 least=20 grace=8 slug=cuda
    declare -A want=([a]=150 [b]=90 [c]=90 [d]=75 [e]=$total)
fi
OUT=${OUT:-bench/results/first-run-$slug}
mkdir -p "$OUT" || exit 2
JSONL=$OUT/first-run.jsonl LOG=$OUT/first-run.log
deadline=$((SECONDS + total))
failed=0

event() {  # part, event, detail, rc: one line of the script's own
    local detail=${3//\"/\'}
    printf '{"part": "%s", "event": "%s", "detail": "%s", "rc": %s, "elapsed_s": %d}\n' "$1" "$2" "$detail" \
        "${4:-null}" "$SECONDS" | tee -a "$JSONL"
}

budget_for() {  # part: its seconds, cut to what the run has left; empty (and a line saying so) when too few are left
    local left=$((deadline - SECONDS - reserve))
    local give=$((want[$1] < left ? want[$1] : left))
    if [ "$give" -lt "$least" ]; then
        event "$1" skipped "no time left: $left s of the run's budget for a part that needs at least $least s" >&2
        return 1
    fi
    echo "$give"
}

finished() {  # part, rc, hard limit
    case $2 in
        0) event "$1" done "" "$2" ;;
        124 | 137) event "$1" killed "over its hard limit of $3 s" "$2"; failed=1 ;;
        *) event "$1" failed "exit $2 (log: first-run.log)" "$2"; failed=1 ;;
    esac
}

part() {  # a-d: bench/first_run.py --part NAME, which stops itself at its budget; the hard limit is for a hang
    local give limit
    give=$(budget_for "$1") || return 0
    limit=$((give + grace))
    echo "== part $1: budget $give s, at $SECONDS s of $total s" | tee -a "$LOG"
    # the part's clock and its kill limit start together: --deadline is absolute (epoch seconds), so the part's
    # imports (10-30 s on a loaded machine) count against its budget
    PYTHONUNBUFFERED=1 timeout -k 5 "$limit" "$PYTHON" bench/first_run.py --part "$1" --out "$JSONL" \
        --budget "$give" --deadline "$(($(date +%s) + give))" "${dry_flag[@]}" 2>&1 | tee -a "$LOG"
    finished "$1" "${PIPESTATUS[0]}" "$limit"
}

tests() {  # e: the GPU tests (in the dry run, their collection) with what time is left, then their summary line
    local give summary
    give=$(budget_for e) || return 0
    # the GPU's tests first; -rA names every test's outcome, so a run interrupted at its budget says which ran
    local args=(-q -p no:cacheprovider -rA --gpu-first)
    [ "$dry" = 1 ] && args=(--collect-only -q -p no:cacheprovider --gpu-first)
    mapfile -t files < <(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' bench/gpu_tests.txt)
    echo "== part e: pytest ${args[*]} ${files[*]} (budget $give s, at $SECONDS s of $total s)" | tee -a "$LOG"
    # SIGINT at the budget: pytest stops after the test in progress and prints its summary (-rA); killed 5 s later
    PYTHONUNBUFFERED=1 timeout -s INT -k 5 "$give" "$PYTHON" -m pytest "${args[@]}" "${files[@]}" 2>&1 \
        | tee -a "$LOG" | tee "$OUT/tests.tmp"
    local rc=${PIPESTATUS[0]}
    summary=$(grep -E '(passed|failed|error|skipped|collected|no tests ran)' "$OUT/tests.tmp" | tail -n 1)
    rm -f "$OUT/tests.tmp"
    event e tests "${summary:-no summary line: cut (see first-run.log)}" "$rc"
    if [ "$rc" = 124 ]; then  # SIGINT at its budget: part e takes what is left, so a cut is its plan, not a fault
        event e cut "at its budget of $give s: the tests above ran (log: first-run.log)" "$rc"
        return 0
    fi
    finished e "$rc" "$give"
}

# exit 3: no CUDA (a GPU run), 4: this checkout is not importable (then installed offline)
"$PYTHON" -c "import sys, torch
if not ($dry or torch.cuda.is_available()):
    sys.exit(3)
try:
    import lookahead.kernels, lookahead.models
except ImportError:
    sys.exit(4)"
case $? in
    0) ;;
    3) event setup error "no CUDA GPU visible to torch: on a CPU run bash bench/gpu_first_run.sh --dry-run"; exit 2 ;;
    4) if ! "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
        # no pip or setuptools that can: the three folders laid out as the package they install as, on PYTHONPATH
        shim=$(mktemp -d)
        trap 'rm -rf "$shim"' EXIT
        mkdir "$shim/lookahead"
        ln -s "$PWD"/lookahead/* "$shim/lookahead/"
        ln -s "$PWD/kernels" "$shim/lookahead/kernels"
        ln -s "$PWD/models" "$shim/lookahead/models"
        # and no current or script folder first on sys.path (Python >= 3.11), where ./lookahead would shadow it
        export PYTHONPATH=$shim:$PWD/bench${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1
        "$PYTHON" -c "import lookahead.kernels, lookahead.models" >>"$LOG" 2>&1 \
            || { event setup error "lookahead is not importable, even from $shim (log: first-run.log)"; exit 2; }
        event setup shim "pip install -e . failed; lookahead imported from $shim"
    fi ;;
    *) event setup error "$PYTHON could not import torch"; exit 2 ;;
esac
# the commit: git's, recorded in bench/COMMIT for a copy without .git (bench/common.py reads it there)
if commit=$(git rev-parse --short HEAD 2>/dev/null); then
    git diff --quiet HEAD -- 2>/dev/null || commit="$commit+changes"
    echo "$commit" >bench/COMMIT 2>/dev/null || true
else
    commit=$(cat bench/COMMIT 2>/dev/null || echo "unknown: no .git and no bench/COMMIT")
fi
event setup start "parts: $parts; dry run: $dry${stretch:+ (seconds x$stretch for the load)}; budget $total s; commit $commit"
dry_flag=()
[ "$dry" = 1 ] && dry_flag=(--dry-run)
for name in $parts; do
    case $name in
        a | b | c | d) part "$name" ;;
        e) tests ;;
        *) event "$name" skipped "no such part (a-e)" ;;
    esac
done
event setup end "$((SECONDS)) s of the $total s budget" "$failed"
exit $failed
