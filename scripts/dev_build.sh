#!/usr/bin/env bash
# Developer build without pip: configure + build into build/<name>, then copy the
# extension modules next to the Python sources so `PYTHONPATH=python` imports them.
#   scripts/dev_build.sh                 # CPU-only build in build/dev
#   BUILD=build/dev-cuda PCIE_A2A_WITH_CUDA=1 PCIE_A2A_CUDA_ARCHS="90-real;120-real" \
#     scripts/dev_build.sh _cuda         # also CUDA, only the _cuda target
# Extra arguments are target names (default: all). PYTHON: the interpreter to build for
# (default python3); CMAKE_ARGS: more configure arguments; JOBS: parallel jobs (default 2).
# Uses Ninja when it is installed, else Makefiles.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build/dev}
python=$(command -v "${PYTHON:-python3}")
: "${PCIE_A2A_WITH_CUDA:=0}"
export PCIE_A2A_WITH_CUDA
pybind_dir=$("$python" -c 'import pybind11; print(pybind11.get_cmake_dir())')
generator=()
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi
# shellcheck disable=SC2086 # CMAKE_ARGS is a list of arguments
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -Dpybind11_DIR="$pybind_dir" \
  -DPython_EXECUTABLE="$python" ${CMAKE_ARGS:-} >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build" -j "${JOBS:-2}" "${targets[@]}"
# Install each module by rename, never by copying over it: cp rewrites the file in place, and
# a process that has the old module loaded (a test or bench rank still running, e.g. another
# session's on a shared checkout) then dies with SIGBUS/SIGSEGV on its next call into it. A
# rename leaves such processes their old file; only new imports see the new one.
for so in "$build"/_*.so; do
  [ -e "$so" ] || continue
  dst=python/pcie_a2a/$(basename "$so")
  cp -f "$so" "$dst.tmp.$$"
  mv -f "$dst.tmp.$$" "$dst"
done
