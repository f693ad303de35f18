#!/usr/bin/env bash
# Installs the pinned SGLang and vLLM releases *without* their GPU dependencies, plus the
# small set of packages their MoE/plugin modules need to import on a CPU-only machine, into
# the CURRENT Python environment (activate a venv first). Used by the framework tests.
#
#   scripts/install_framework_test_deps.sh            # both frameworks
#   scripts/install_framework_test_deps.sh sglang     # only SGLang
#   scripts/install_framework_test_deps.sh vllm       # only vLLM
#
# torch is pinned to 2.13.0 (the local CPU wheel) through a constraints file, so nothing can
# pull CUDA torch; torchvision is never installed (tests/stubs/torchvision stands in).
# Idempotent: packages already at the right version are left alone.
set -euo pipefail

SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
WHAT=("$@")
[ ${#WHAT[@]} -eq 0 ] && WHAT=(sglang vllm)

start=$(date +%s)
PY="${PYTHON:-python}"
if [ -z "${VIRTUAL_ENV:-}" ] && [ "${PCIE_A2A_ALLOW_SYSTEM_PIP:-0}" != "1" ]; then
  echo "install_framework_test_deps: activate a virtual environment first" \
    "(or set PCIE_A2A_ALLOW_SYSTEM_PIP=1)" >&2
  exit 2
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
cat >"$constraints" <<CONS
torch==${TORCH_VERSION}
CONS

pipi() { "$PY" -m pip install --quiet --constraint "$constraints" "$@"; }

have() { # have NAME VERSION -> 0 when that exact version is installed
  "$PY" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    sys.exit(0 if version(sys.argv[1]) == sys.argv[2] else 1)
except PackageNotFoundError:
    sys.exit(1)
PYEOF
}

have torch "$TORCH_VERSION" || have torch "${TORCH_VERSION}+cpu" || pipi "torch==${TORCH_VERSION}"
pipi numpy pytest

for fw in "${WHAT[@]}"; do
  case "$fw" in
    sglang)
      # Import closure of sglang.srt.{plugins,layers.moe.*,arg_groups,server_args} on CPU.
      pipi orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic \
        pyzmq tqdm ipython aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" \
        sentencepiece einops compressed-tensors gguf openai partial_json_parser
      have sglang "$SGLANG_VERSION" || pipi --no-deps "sglang==${SGLANG_VERSION}"
      ;;
    vllm)
      pipi packaging psutil pyzmq urllib3 regex pydantic cbor2 "transformers==5.19.0" aiohttp \
        requests openai-harmony openai triton-kernels pillow pybase64 cachetools msgspec \
        cloudpickle uvloop py-cpuinfo prometheus-client xgrammar fastapi partial-json-parser \
        llguidance einops triton
      have vllm "$VLLM_VERSION" || pipi --no-deps "vllm==${VLLM_VERSION}"
      ;;
    *)
      echo "install_framework_test_deps: unknown framework '$fw' (sglang|vllm)" >&2
      exit 2
      ;;
  esac
done

if "$PY" -c 'import importlib.util,sys; sys.exit(importlib.util.find_spec("torchvision") is None)'; then
  echo "install_framework_test_deps: warning: a real torchvision is installed; the tests" \
    "use tests/stubs/torchvision only when none is importable" >&2
fi
"$PY" -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; \
assert not torch.version.cuda, 'CUDA torch was pulled in'"
echo "install_framework_test_deps: ${WHAT[*]} ready in $(( $(date +%s) - start ))s"
