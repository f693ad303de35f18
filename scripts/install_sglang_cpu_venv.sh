#!/usr/bin/env bash
# Creates a virtual environment in which SGLang 0.5.23's CPU engine can run a real
# `python -m sglang.launch_server` for the real-server framework test.
#
#   scripts/install_sglang_cpu_venv.sh DIR     # then PCIE_A2A_SGLANG_CPU_PYTHON=DIR/bin/python
#
# SGLang pins torch 2.14.1 and a long list of CUDA packages; here torch is 2.13.0 (CPU),
# pinned through a constraints file so nothing can pull a CUDA torch, sglang is installed
# with --no-deps, and then only what the server imports at start-up on the CPU engine. Two
# imports have no CPU wheel on PyPI (torchvision: CUDA builds only; sgl_kernel's CPU build:
# not published): the test puts stand-ins for them on the server's path
# (tests/framework/sglang_cpu_support), nothing is installed for them here.
# Idempotent: an existing DIR with the right sglang is left alone.
set -euo pipefail

dir="${1:?usage: install_sglang_cpu_venv.sh DIR}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
start=$(date +%s)

py="$dir/bin/python"
[ -x "$py" ] || python3 -m venv "$dir"

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==${TORCH_VERSION}" >"$constraints"
pipi() { "$py" -m pip install --quiet --constraint "$constraints" "$@"; }

have() { # have NAME VERSION -> 0 when that exact version is installed
  "$py" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    sys.exit(0 if version(sys.argv[1]).split("+")[0] == sys.argv[2] else 1)
except PackageNotFoundError:
    sys.exit(1)
PYEOF
}

have torch "$TORCH_VERSION" || pipi "torch==${TORCH_VERSION}"
if ! have sglang "$SGLANG_VERSION"; then
  # What launch_server, its tokenizer manager, scheduler and model runner import on the CPU
  # engine (found by starting the server), at the versions SGLang 0.5.23 pins where it pins.
  pipi "transformers==5.19.0" "tokenizers==0.23.2" "compressed-tensors==0.18.0" \
    "xgrammar==0.2.7" "openai==2.8.0" "apache-tvm-ffi==0.1.11" \
    fastapi "uvicorn>=0.51" uvloop pyzmq orjson pydantic msgspec partial_json_parser gguf \
    triton numpy psutil pybase64 requests packaging pillow aiohttp setproctitle \
    python-multipart interegular einops sentencepiece dill ipython tqdm prometheus-client \
    llguidance safetensors jsonschema soundfile
  pipi --no-deps "sglang==${SGLANG_VERSION}"
fi

"$py" - "$TORCH_VERSION" "$SGLANG_VERSION" <<'PYEOF'
import sys
from importlib.metadata import version

import torch

assert torch.__version__.startswith(sys.argv[1]), torch.__version__
assert not torch.version.cuda, "a CUDA torch was pulled in"
assert version("sglang") == sys.argv[2], version("sglang")
print(f"install_sglang_cpu_venv: sglang {version('sglang')}, torch {torch.__version__}")
PYEOF
echo "install_sglang_cpu_venv: $dir ready in $(($(date +%s) - start))s"
