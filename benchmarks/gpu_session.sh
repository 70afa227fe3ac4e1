#!/usr/bin/env bash
# Every GPU check and benchmark of reprop, in parts that each fit one device call.
#
#   bash benchmarks/gpu_session.sh [--dry-run] [--device cpu --quick] PART...
#
# PART: build, tests, bench-a, bench-b, bench-c, or all (the five in turn, no time guard:
# for a machine without a per-command limit). Run from the repository root.
# Results (JSON, logs, the tests' JUnit XML) go to $OUT (default ./gpu_session_out);
# `python3 benchmarks/gpu_session.py $OUT` turns the JSON into RESULTS.md rows.
#
# The device lends one H200 for 30 minutes per session, at most 10 per command,
# each fresh machine bare. So each part builds reprop first when this checkout's
# build lacks CUDA (about 200 s; carry a build made elsewhere to skip it: README),
# the issues' targets (BPPSA #5, out-of-order #6) run first, and a time guard
# (GPU_SESSION_BUDGET_S, default 510 s counted
# from the script's start) shortens each command's timeout to what is left and
# skips, with a line saying so, the commands no time is left for. Each part
# writes at most 8 files (what a call brings back). Calls:
#   run: bash benchmarks/gpu_session.sh build tests   (timeout_s 600)
#   run: bash benchmarks/gpu_session.sh bench-a       (timeout_s 600)
#   run: bash benchmarks/gpu_session.sh bench-b       (timeout_s 600)
#   run: bash benchmarks/gpu_session.sh bench-c       (timeout_s 600)
#
# Estimates (seconds on an H200; most measured there on 2026-11-25, each
# command's comment says): 20 s of start-up
# (python, torch, CUDA context, model builds) plus rounds x candidates x
# cases x step time, the step time from the sizes (bytes / 3.5 TB/s for the
# optimizers; about 30-100 ms for a 224x224 batch-32 CNN step; a cuDNN RNN
# step of about 15 us per time step), then x1.5. --dry-run prints them with
# each part's total, which tests/test_benchmarks.py keeps under the budget.
#
# --dry-run: print the commands (part, estimate, timeout, command) instead of
# running them. --device cpu --quick: the CPU smoke run, each benchmark with
# --device cpu --quick (no --reps, no GPU build), to check the script and the
# collector anywhere.
set -euo pipefail

PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_session_out}
# the checkout's package first: a build carried into python/reprop (README) is
# then used as it is, and the build part's `pip install -e .` builds there too
PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export OUT PYTHONPATH PYTHONUNBUFFERED=1
DRY_RUN=0
SMOKE=0
BUDGET_S=${GPU_SESSION_BUDGET_S:-510}
BUILD_ESTIMATE_S=200  # nvcc for sm_80 and sm_90 plus PTX: 199 s on the H200 (2026-11-25)
START_S=$SECONDS

# Each benchmark command: "part|estimate s|timeout s|command". The issue
# targets come first in bench-a: bppsa's T sweep holds T=1000, B=16, d=20
# (issue 5) and ooo's first command DenseNet-121 k=12 batch 32 (issue 6).
BENCHMARKS=(
  # estimates: 1.2-1.3 x what each took on the H200 (2026-11-25), where measured
  # T in 10..30000 x 3 candidates x 12 rounds (took 19 s)
  'bench-a|25|240|python3 benchmarks/bppsa.py --device cuda --part rnn-t --json $OUT/bppsa-cuda-t.json'
  # 4 kinds x 2 builds (check, timed) x about 20 steps of about 30 ms, plus captures (took 34 s)
  'bench-a|45|240|python3 benchmarks/ooo.py --device cuda --parts single --models densenet121_k12 --batches 32 --json $OUT/ooo-cuda-target.json'
  # T=1000 with both sides' calls captured in CUDA graphs: 4 captures, 4 candidates x 12 rounds; then
  # the scan alone at its 10 levels x 12 rounds and its kernels under the profiler (not measured yet)
  'bench-a|30|150|python3 benchmarks/bppsa.py --device cuda --part graph --part scan --json $OUT/bppsa-cuda-graph.json'
  # 8 batches + 6 hiddens at T=1000, 9 GRU cases, the VGG-11 chain at 1/8 width (took 86 s)
  'bench-a|110|300|python3 benchmarks/bppsa.py --device cuda --part rnn-batch --part rnn-hidden --part gru --part vgg --json $OUT/bppsa-cuda-rest.json'
  # 3 optimizers x 2 cases x 5 candidates x 28 rounds of about 1 ms (took 15 s)
  'bench-a|25|180|python3 benchmarks/optim.py --device cuda --json $OUT/optim-cuda.json'
  # bfloat16 autocast steps of both models (not measured yet)
  'bench-a|60|180|python3 benchmarks/fad.py --device cuda --amp --parts steps --reps 10 --mem-cap-gib 0 --json $OUT/fad-cuda-amp.json'
  # 6 models + 5 batches + 6 optimizers, 7 candidates x 13 steps of 20-100 ms (took 134 s)
  'bench-b|160|300|python3 benchmarks/fusion.py --device cuda --reps 10 --json $OUT/fusion-cuda.json'
  # 12-layer BERT-base, 2 activations x 8 candidates x 13 steps, no largest-batch search (took 92 s)
  'bench-b|110|180|python3 benchmarks/fad.py --device cuda --models bert_base --reps 10 --mem-cap-gib 0 --json $OUT/fad-cuda-bert.json'
  # 8 models x 2 batches x 4 kinds x 6 rounds, about 9 s a row (builds, captures; not measured yet)
  'bench-c|150|300|python3 benchmarks/ooo.py --device cuda --parts single,split,simulate --reps 5 --json $OUT/ooo-cuda.json'
  # ResNet-50, 3 activations x 8 candidates x 13 steps of about 50 ms, the search under 2 GiB (not measured yet)
  'bench-c|120|300|python3 benchmarks/fad.py --device cuda --models resnet50 --reps 10 --mem-cap-gib 2 --json $OUT/fad-cuda-resnet.json'
)

say() { printf 'gpu_session: %s\n' "$*"; }

elapsed() { echo $((SECONDS - START_S)); }

# Seconds left under the guard (a large number without one).
time_left() {
  if [ "$BUDGET_S" -le 0 ]; then echo 999999; else echo $((BUDGET_S - $(elapsed))); fi
}

# The command as this run executes it: the CPU smoke run swaps the device and drops --reps.
adapt() {
  local cmd=$1
  if [ "$SMOKE" = 1 ]; then
    cmd=${cmd//--device cuda/--device cpu --quick}
    cmd=${cmd//-cuda/-smoke}
    cmd=$(sed -E 's/ --reps [0-9]+//; s/ --mem-cap-gib [0-9.]+//' <<<"$cmd")
  fi
  echo "${cmd/#python3 /$PY }"
}

# Run one command under min(its timeout, the time left), its output appended to LOG, stopped
# with SIGNAL (default TERM). A failure or timeout is reported and the part goes on: later
# figures still count.
run_timed() {
  local log=$1 estimate=$2 limit=$3 cmd=$4 signal=${5:-TERM} left
  left=$(( $(time_left) - 15 ))
  if [ "$left" -lt 30 ]; then
    say "SKIPPED (time guard, $(elapsed) s used of $BUDGET_S): $cmd" | tee -a "$log"
    return 0
  fi
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  say "run [estimate ${estimate} s, timeout ${limit} s, at $(elapsed) s]: $cmd" | tee -a "$log"
  local t0=$SECONDS rc=0
  timeout -s "$signal" -k 20 "$limit" bash -c "$cmd" >>"$log" 2>&1 || rc=$?
  say "done rc=$rc (124: timed out) in $((SECONDS - t0)) s: $cmd" | tee -a "$log"
}

# Whether the installed reprop (pip install -e . of this checkout) has its CUDA extension.
reprop_has_cuda() {
  "$PY" -c 'import reprop, sys; sys.exit(0 if reprop.cuda_built() else 1)' 2>/dev/null
}

# The GUIDE's install recipe (no network there, so no build isolation), then what was built.
part_build() {
  local log=$OUT/build.log
  if [ "$SMOKE" = 1 ]; then
    say "smoke run: no build, the checkout's extension as it is" | tee -a "$log"
  elif reprop_has_cuda; then
    say "reprop already built with CUDA: no rebuild" | tee -a "$log"
  else
    say "building (estimate ${BUILD_ESTIMATE_S} s)" | tee -a "$log"
    if ! REPROP_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e . -q >>"$log" 2>&1; then
      tail -n 60 "$log"
      say "build FAILED (log: $log)"
      exit 1
    fi
  fi
  {
    "$PY" -c 'import reprop, torch
print("reprop", reprop.__version__, reprop.__file__)
print("cuda_built", reprop.cuda_built(), "cuda_available", reprop.cuda_available(),
      "cuda_archs", reprop.cuda_archs(), "cuda_error", reprop.cuda_error())
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())'
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
  } 2>&1 | tee -a "$log"
}

# Build when a part runs on a fresh machine (no-op on one that built already).
ensure_built() {
  if [ "$SMOKE" = 0 ] && ! reprop_has_cuda; then part_build; fi
}

TESTS_CMD='python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --durations=30 --junitxml=$OUT/gpu-tests.xml'

# pytest -m gpu until the guard, then SIGINT: pytest stops there and still writes its
# summary, the slowest durations and the XML.
part_tests() {
  ensure_built
  local cmd
  cmd=$(adapt "$TESTS_CMD")
  # four workers where pytest-xdist is there (the H200 image has it): 177 s, not some 10 minutes
  if "$PY" -c 'import xdist' 2>/dev/null; then cmd="$cmd -n 4"; fi
  run_timed "$OUT/gpu-tests.log" - 999999 "$cmd" INT
  tail -n 45 "$OUT/gpu-tests.log"
}

part_bench() {
  local part=$1 entry p est limit cmd
  ensure_built
  for entry in "${BENCHMARKS[@]}"; do
    IFS='|' read -r p est limit cmd <<<"$entry"
    [ "$p" = "$part" ] || continue
    run_timed "$OUT/$part.log" "$est" "$limit" "$(adapt "$cmd")"
  done
  grep -E 'PASS|MISS|FAIL' "$OUT/$part.log" || true
}

# part<TAB>estimate<TAB>timeout<TAB>command per command, then each part's total estimate
# with the build a fresh machine needs first, against the guard.
dry_run() {
  local part=$1 entry p est limit cmd total=$BUILD_ESTIMATE_S
  case $part in
    build) printf 'build\t%s\t-\t%s\n' "$BUILD_ESTIMATE_S" "REPROP_CUDA=1 $PY -m pip install --no-build-isolation --no-deps -e . -q";;
    tests) printf 'tests\t-\t-\t%s\n' "$(adapt "$TESTS_CMD")";;
    *)
      for entry in "${BENCHMARKS[@]}"; do
        IFS='|' read -r p est limit cmd <<<"$entry"
        [ "$p" = "$part" ] || continue
        printf '%s\t%s\t%s\t%s\n' "$p" "$est" "$limit" "$(adapt "$cmd")"
        total=$((total + est))
      done
      printf 'total\t%s\t%s\t%s\n' "$part" "$total" "$BUDGET_S";;
  esac
}

main() {
  local parts=()
  while [ $# -gt 0 ]; do
    case $1 in
      --dry-run) DRY_RUN=1;;
      --device) [ "${2:-}" = cpu ] || { echo "--device: only cpu (the smoke run)" >&2; exit 2; }
                SMOKE=1; shift;;
      --quick) SMOKE=1;;
      all) parts+=(build tests bench-a bench-b bench-c)
           [ -n "${GPU_SESSION_BUDGET_S:-}" ] || BUDGET_S=0;;
      build|tests|bench-a|bench-b|bench-c) parts+=("$1");;
      *) echo "unknown part or option: $1 (build, tests, bench-a, bench-b, bench-c, all)" >&2; exit 2;;
    esac
    shift
  done
  [ ${#parts[@]} -gt 0 ] || { echo "usage: $0 [--dry-run] [--device cpu --quick] PART..." >&2; exit 2; }
  local part
  if [ "$DRY_RUN" = 1 ]; then
    for part in "${parts[@]}"; do dry_run "$part"; done
    return 0
  fi
  mkdir -p "$OUT"
  for part in "${parts[@]}"; do
    say "part $part at $(elapsed) s"
    case $part in
      build) part_build;;
      tests) part_tests;;
      *) part_bench "$part";;
    esac
  done
  say "finished at $(elapsed) s; files under $OUT:"
  ls -l "$OUT"
}

main "$@"
