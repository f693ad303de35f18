#!/usr/bin/env bash
# The first GPU run of pcie_a2a in one call, with a verdict (issue 10; docs/gpu_check.md).
#
#   LOG_DIR=$OUT scripts/gpu_check.sh    # on the device machine: everything comes back
#   scripts/gpu_check.sh --plan          # the steps and their budgets (no GPU needed)
#
# Preflight, build (this GPU's architecture, all cores), transport tests in two tiers, the
# stress test, the in-process harness, the all-reduce, the other GPU tests, the INT4 tests
# and, in time left over (optional), reduced benchmarks, a per-kernel breakdown and
# compute-sanitizer: each step under one deadline (BUDGET_S, default 480 s), a row printed
# as it ends, the result files (summary, JUnit XML, results JSON, log archive, built
# modules) rewritten in LOG_DIR after every step; the output ends with the command that
# continues where the run stopped. Exit status: 0 PASS, 1 FAIL (a wrong result, a crash, a
# build error), 2 bad settings, 3 no GPU, 4 INCOMPLETE (no failure, but a step ran out of
# time, ran nothing or never ran). The steps live in scripts/gpu_check_plan.py. It runs
# under the machine's own python3 and torch (the H200 image's CUDA torch) and installs none.
#
# Python packages the machine lacks (cmake, ninja, pybind11, pytest-timeout, ...) can
# travel as wheels in .whl/ (carry it): they are installed into a temporary folder first.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
if [[ -n "${OUT:-}" && -z "${LOG_DIR:-}" ]]; then
  export LOG_DIR=$OUT
fi
if ! command -v python3 >/dev/null 2>&1; then
  echo "gpu_check: python3 not found on PATH; nothing was run" >&2
  exit 2
fi
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})) && [[ "${1:-}" != --plan* ]]; then
  site=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "${wheels[@]}"; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
    echo "gpu_check: installed ${#wheels[@]} carried wheel(s) into $site"
  else
    echo "gpu_check: installing the carried wheels in .whl failed; going on without them"
  fi
fi
exec python3 -u scripts/gpu_check.py "$@"
