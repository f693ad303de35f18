"""vLLM backend: a Standard-format modular-kernel prepare/finalize on pcie_a2a.

Loaded through the entry point group ``vllm.general_plugins`` (name ``pcie_a2a``, object
``pcie_a2a.integrations.vllm:register``) and selected with the environment variable
``PCIE_A2A_VLLM=1`` together with ``--enable-expert-parallel --data-parallel-size N``
(vLLM 0.33's ``--all2all-backend`` is a closed Literal, so it cannot take a new name).
Importing this package imports vLLM and checks its version (>=0.33,<0.34).
See docs/vllm.md.
"""

from __future__ import annotations

from pcie_a2a.integrations._common import check_version

MIN_VERSION = (0, 33)
BELOW_VERSION = (0, 34)
TESTED_VERSION = "0.33.0"
SKIP_VERSION_CHECK_ENV = "PCIE_A2A_VLLM_SKIP_VERSION_CHECK"

VLLM_VERSION = check_version("vllm", None, MIN_VERSION, BELOW_VERSION, SKIP_VERSION_CHECK_ENV)

from pcie_a2a.integrations.vllm.plugin import ENABLE_ENV, is_enabled, register  # noqa: E402
from pcie_a2a.integrations.vllm.prepare_finalize import PcieA2APrepareAndFinalize  # noqa: E402

__all__ = [
    "ENABLE_ENV",
    "VLLM_VERSION",
    "PcieA2APrepareAndFinalize",
    "is_enabled",
    "register",
]
