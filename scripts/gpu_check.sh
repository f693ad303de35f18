#!/usr/bin/env bash
# Builds pcie_a2a for the local GPU and runs every GPU test plus a short benchmark; prints
# a summary table last. Budget (not yet timed on a GPU): build ~2-3 min, GPU tests <= 5 min
# + 2 min, one-GPU CUDA bench <= 3.5 min, bench <= 2 min; on a machine with a 10-minute
# limit per command run it in two calls (see SKIP_* below). Exit status: non-zero when the
# build or any GPU test failed (the benchmarks only report).
#   scripts/gpu_check.sh              # build in build/gpu-check, run everything
#   SKIP_BUILD=1 scripts/gpu_check.sh # reuse the modules already in python/pcie_a2a
#   SKIP_BENCH=1 / SKIP_TESTS=1       # split one check over two calls of a time-limited
#                                     # machine (e.g. build + tests, then SKIP_BUILD=1
#                                     # SKIP_TESTS=1 for the benchmarks)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
log_dir=${LOG_DIR:-build/gpu-check-logs}
mkdir -p "$log_dir"
declare -a rows=()
status=0
row() { rows+=("$(printf '%-34s %-8s %8s  %s' "$1" "$2" "$3" "$4")"); }
now() { date +%s; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
  | head -1 > "$log_dir/gpu.txt" || echo "no nvidia-smi" > "$log_dir/gpu.txt"

# ---- build (native SASS for this GPU only) ------------------------------------------------
t0=$(now)
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  if BUILD=${BUILD:-build/gpu-check} PCIE_A2A_WITH_CUDA=1 PCIE_A2A_CUDA_ARCHS=native \
      JOBS=${JOBS:-$(nproc)} timeout 300 scripts/dev_build.sh > "$log_dir/build.log" 2>&1; then
    row "build (archs=native)" ok "$(( $(now) - t0 ))s" ""
  else
    row "build (archs=native)" FAIL "$(( $(now) - t0 ))s" "see $log_dir/build.log"
    status=1
  fi
else
  row "build" skipped "0s" "SKIP_BUILD=1"
fi

# ---- GPU tests ---------------------------------------------------------------------------
run_pytest() {  # name, timeout, pytest args...
  local name=$1 limit=$2
  shift 2
  local t=$(now) log="$log_dir/${name//[^a-zA-Z0-9_]/_}.log"
  timeout "$limit" python -m pytest -m gpu -q -p no:cacheprovider "$@" > "$log" 2>&1
  local rc=$?
  local tail_line
  tail_line=$(grep -E "passed|failed|skipped|error" "$log" | tail -1)
  if [[ $rc -eq 0 && "$tail_line" != *passed* ]]; then
    row "$name" SKIPPED "$(( $(now) - t ))s" "$tail_line (nothing ran: no GPU or no CUDA build?)"
    [[ "$name" == *"cuda transport"* ]] && status=1
  elif [[ $rc -eq 0 ]]; then
    row "$name" ok "$(( $(now) - t ))s" "$tail_line"
  else
    [[ $rc -eq 124 ]] && tail_line="TIMEOUT after ${limit}s"
    row "$name" FAIL "$(( $(now) - t ))s" "$tail_line ($log)"
    status=1
  fi
}
if [[ "${SKIP_TESTS:-0}" == 1 ]]; then
  row "pytest -m gpu" skipped "0s" "SKIP_TESTS=1"
elif [[ $status -eq 0 ]]; then
  run_pytest "pytest -m gpu: cuda transport" 300 tests/test_cuda_transport.py
  others=$(grep -l "mark.gpu" tests/*.py 2>/dev/null | grep -v test_cuda_transport.py | tr '\n' ' ')
  if [[ -n "$others" ]]; then
    # shellcheck disable=SC2086
    run_pytest "pytest -m gpu: other files" 120 $others
  fi
fi

# ---- one-GPU CUDA transport benchmark (ranks share GPU 0: not PCIe numbers) ---------------
# Skipped when the build or a GPU test failed, to save device time. Its table is printed
# again just above the summary; the JSON is $log_dir/bench_cuda_one_gpu.json.
t=$(now)
one_gpu_log="$log_dir/bench_cuda_one_gpu.log"
rm -f "$one_gpu_log" "$log_dir/bench_cuda_one_gpu.json"  # no stale table from an earlier run
if [[ "${SKIP_BENCH:-0}" == 1 ]]; then
  row "bench cuda one GPU (1-8 ranks)" skipped "0s" "SKIP_BENCH=1"
elif [[ $status -eq 0 ]]; then
  timeout 210 python benchmarks/bench_cuda_one_gpu.py --json "$log_dir/bench_cuda_one_gpu.json" \
    > "$one_gpu_log" 2>&1
  rc=$?
  case $rc in
    0) row "bench cuda one GPU (1-8 ranks)" ok "$(( $(now) - t ))s" "table below; $one_gpu_log" ;;
    2) row "bench cuda one GPU (1-8 ranks)" skipped "$(( $(now) - t ))s" "$(tail -1 "$one_gpu_log")" ;;
    124) row "bench cuda one GPU (1-8 ranks)" FAIL "$(( $(now) - t ))s" "TIMEOUT after 210s ($one_gpu_log)" ;;
    *) row "bench cuda one GPU (1-8 ranks)" FAIL "$(( $(now) - t ))s" "a world failed or rc=$rc ($one_gpu_log)" ;;
  esac
else
  row "bench cuda one GPU (1-8 ranks)" skipped "0s" "build or a GPU test failed"
fi

# ---- short benchmark (pcie-a2a bench --backend cuda vs NCCL baselines) -------------------
# One rank per GPU (2..8 ranks) gives the NCCL all_to_all_single and all-gather +
# reduce-scatter baselines. NCCL cannot put two ranks on one GPU, so on a one-GPU machine
# 2 ranks share GPU 0, only our path runs and the baselines print "n/a: NCCL needs one GPU
# per rank". Kimi K2 decode shapes, 128 tokens per rank, bf16 and fp8, at most 20 timed
# iterations and 10 s per config; --timeout 100 makes the command report the configs that
# finished before this script's 120 s limit. Its table is printed above the summary, and
# the summary row shows the last dispatch+combine line; the JSON is $log_dir/bench.json.
t=$(now)
bench_log="$log_dir/bench.log"
rm -f "$bench_log" "$log_dir/bench.json"  # no stale table from an earlier run
ngpu=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [[ "${SKIP_BENCH:-0}" == 1 ]]; then
  row "bench cuda" skipped "0s" "SKIP_BENCH=1"
else
  world=$(( ngpu >= 2 ? (ngpu > 8 ? 8 : ngpu) : 2 ))
  name="bench cuda (world=$world, gpus=$ngpu)"
  timeout 120 python -m pcie_a2a bench --backend cuda --world "$world" --tokens 128 \
    --iters 20 --warmup 3 --max-seconds 10 --timeout 100 \
    --json "$log_dir/bench.json" --plot none > "$bench_log" 2>&1
  rc=$?
  detail=$(grep -E "dispatch\+combine p50" "$bench_log" | tail -1)
  case $rc in
    0) row "$name" ok "$(( $(now) - t ))s" "$detail" ;;
    2) row "$name" skipped "$(( $(now) - t ))s" "$(tail -1 "$bench_log")" ;;
    124) row "$name" FAIL "$(( $(now) - t ))s" "TIMEOUT after 120s ($bench_log)" ;;
    *) row "$name" FAIL "$(( $(now) - t ))s" "rc=$rc ${detail:+(last: $detail) }($bench_log)" ;;
  esac
fi

# ---- summary (last) ----------------------------------------------------------------------
if [[ -s "$bench_log" ]] && grep -q "^machine: " "$bench_log"; then
  echo
  echo "pcie-a2a bench --backend cuda (from $bench_log):"
  sed -n '/^machine: /,$p' "$bench_log" | grep -v "^JSON: "
fi
if [[ -s "$one_gpu_log" ]] && grep -qE "^world +payload" "$one_gpu_log"; then
  echo
  echo "bench_cuda_one_gpu (from $one_gpu_log):"
  sed -n '/^world  *payload/,$p' "$one_gpu_log"
fi
echo
echo "pcie_a2a GPU check on: $(cat "$log_dir/gpu.txt")"
printf '%-34s %-8s %8s  %s\n' "step" "result" "time" "detail"
printf '%s\n' "${rows[@]}"
exit $status
