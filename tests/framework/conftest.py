"""Framework test group: SGLang and vLLM code paths on pcie_a2a's CPU transport.

Needs the pinned frameworks installed without their GPU dependencies
(scripts/install_framework_test_deps.sh, into a separate venv). Each module skips with the
reason when its framework is missing, except under PCIE_A2A_REQUIRE_FRAMEWORKS=1, where it
fails, so CI cannot skip silently. tests/stubs (a torchvision stand-in) is put on sys.path
by those modules only, and only when no real torchvision is importable.
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # fw_utils, also for the spawned rank processes
    sys.path.insert(0, _HERE)
