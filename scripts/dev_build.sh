#!/usr/bin/env bash
# Developer build without pip: configure + build into build/<name>, then copy the
# extension modules next to the Python sources so `PYTHONPATH=python` imports them.
#   scripts/dev_build.sh                 # CPU-only build in build/dev
#   BUILD=build/dev-cuda PCIE_A2A_WITH_CUDA=1 PCIE_A2A_CUDA_ARCHS="90-real;120-real" \
#     scripts/dev_build.sh _cuda         # also CUDA, only the _cuda target
# Extra arguments are module names (default: every module). PYTHON: the interpreter to build
# for (default python3); CMAKE_ARGS: more configure arguments; JOBS: parallel jobs (default 2).
# Uses Ninja when it is installed, else Makefiles.
#
# The build tools are checked first; what is missing is named and nothing is configured
# (exit 2). Each module is built on its own: one that fails to compile does not stop the
# others (ninja -k 0 / make -k), every module that built is installed, and one line per
# module says "ok" or "FAILED" with the sources that failed. The same lines go to
# <build>/pcie_a2a_modules_status.txt (scripts/gpu_check_steps.py reads it). Exit 1 when a
# requested module did not build.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
build=${BUILD:-build/dev}
: "${PCIE_A2A_WITH_CUDA:=0}"
export PCIE_A2A_WITH_CUDA

# ---- the tools, all named at once --------------------------------------------------------
missing=()
python=$(command -v "${PYTHON:-python3}") || missing+=("Python interpreter ${PYTHON:-python3}")
if ! command -v cmake >/dev/null 2>&1; then
  missing+=("cmake (>= 3.24)")
elif ! cmake --version | head -1 | awk '{split($3, v, "."); exit !(v[1] > 3 || (v[1] == 3 && v[2] >= 24))}'; then
  missing+=("cmake >= 3.24 (have $(cmake --version | head -1))")
fi
cxx=${CXX:-}
[[ -z "$cxx" ]] && cxx=$(command -v c++ || command -v g++ || command -v clang++ || true)
[[ -n "$cxx" ]] && command -v "$cxx" >/dev/null 2>&1 || missing+=("a C++ compiler (c++, g++ or clang++, or CXX)")
if ! command -v ninja >/dev/null 2>&1 && ! command -v make >/dev/null 2>&1; then
  missing+=("ninja or make")
fi
pybind_dir=""
if [[ -n "${python:-}" ]]; then
  header=$("$python" -c 'import sysconfig, os; print(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' 2>/dev/null)
  [[ -n "$header" && -f "$header" ]] || missing+=("Python.h for $python (looked for ${header:-its include folder}; install the python3-dev package)")
  pybind_dir=$("$python" -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null) ||
    missing+=("pybind11 for $python (pip install pybind11)")
fi
if [[ "$PCIE_A2A_WITH_CUDA" == 1 || "$PCIE_A2A_WITH_CUDA" == ON ]]; then
  nvcc=${PCIE_A2A_CUDA_TOOLKIT:+$PCIE_A2A_CUDA_TOOLKIT/bin/nvcc}
  nvcc=${nvcc:-${CUDACXX:-$(command -v nvcc || true)}}
  [[ -n "$nvcc" && -x "$nvcc" ]] || missing+=("nvcc (PCIE_A2A_WITH_CUDA=$PCIE_A2A_WITH_CUDA; not on PATH${PCIE_A2A_CUDA_TOOLKIT:+, not in $PCIE_A2A_CUDA_TOOLKIT/bin})")
fi
if ((${#missing[@]})); then
  echo "dev_build: missing build tools, nothing built:" >&2
  for m in "${missing[@]}"; do echo "  - $m" >&2; done
  exit 2
fi

# ---- configure ---------------------------------------------------------------------------
generator=()
keep_going=(-k)
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
  keep_going=(-k 0)
fi
mkdir -p "$build"
# shellcheck disable=SC2086 # CMAKE_ARGS is a list of arguments
if ! cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -Dpybind11_DIR="$pybind_dir" \
  -DPython_EXECUTABLE="$python" ${CMAKE_ARGS:-} >"$build/configure.log" 2>&1; then
  tail -n 40 "$build/configure.log" >&2
  echo "dev_build: cmake configure failed (log: $build/configure.log); nothing built" >&2
  exit 1
fi
list=$build/pcie_a2a_modules.txt  # "<module> <library>..." per module (CMakeLists.txt)
status_file=$build/pcie_a2a_modules_status.txt
mods=("$@")
if ((${#mods[@]} == 0)); then
  mapfile -t mods < <(awk '{print $1}' "$list")
fi
targets=()
for m in "${mods[@]}"; do
  if ! grep -q "^$m " "$list"; then
    echo "dev_build: no module $m in this configuration; modules: $(awk '{printf "%s ", $1}' "$list")" >&2
    exit 2
  fi
  targets+=(--target "$m")
  rm -f "$build/$m".*so  # a module that fails now must not install an old file
done

# ---- build, going on past failures ----------------------------------------------------------
log=$build/build.log
cmake --build "$build" -j "${JOBS:-2}" "${targets[@]}" -- "${keep_going[@]}" 2>&1 | tee "$log"
# Install each module by rename, never by copying over it: cp rewrites the file in place, and
# a process that has the old module loaded (a test or bench rank still running, e.g. another
# session's on a shared checkout) then dies with SIGBUS/SIGSEGV on its next call into it. A
# rename leaves such processes their old file; only new imports see the new one.
: >"$status_file"
failed=0
echo "dev_build: modules in $build:"
shopt -s nullglob
for m in "${mods[@]}"; do
  built=("$build/$m".*so)
  so=${built[0]:-}
  if [[ -n "$so" ]]; then
    dst=python/pcie_a2a/$(basename "$so")
    cp -f "$so" "$dst.tmp.$$"
    mv -f "$dst.tmp.$$" "$dst"
    line="$m ok"
  else
    failed=1
    # the objects of the module and of the libraries it links that failed to compile
    read -r -a libs <<<"$(grep "^$m " "$list" | cut -d' ' -f2-)"
    srcs=()
    for t in "$m" "${libs[@]}"; do
      while IFS= read -r s; do srcs+=("$s"); done < <(
        grep -E '(^FAILED: |\] Error [0-9]+$)' "$log" | grep -oE "CMakeFiles/$t\.dir/[^] :]+\.o" |
          sed -E "s|^CMakeFiles/$t\.dir/||; s|\.o$||" | sort -u
      )
    done
    if ((${#srcs[@]})); then
      line="$m FAILED: did not compile: ${srcs[*]}"
    else
      line="$m FAILED: not built (see $log)"
    fi
  fi
  echo "  $line"
  echo "$line" >>"$status_file"
done
exit "$failed"
