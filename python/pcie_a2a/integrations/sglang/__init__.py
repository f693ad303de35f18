"""SGLang backend: ``--moe-a2a-backend pcie`` (an alias of SGLang's ``customized`` slot).

Loaded by SGLang's plugin loader through the entry point group ``sglang.srt.plugins``
(name ``pcie_a2a``, object ``pcie_a2a.integrations.sglang:register``); see docs/sglang.md.
Importing this package imports SGLang and checks its version (>=0.5.20,<0.6; tested on
0.5.23): outside that range it raises ImportError with the reason, which SGLang's loader
logs as a failed plugin and otherwise ignores.
"""

from __future__ import annotations

from pcie_a2a.integrations._common import check_version

MIN_VERSION = (0, 5, 20)
BELOW_VERSION = (0, 6)
TESTED_VERSION = "0.5.23"
SKIP_VERSION_CHECK_ENV = "PCIE_A2A_SGLANG_SKIP_VERSION_CHECK"

SGLANG_VERSION = check_version("sglang", None, MIN_VERSION, BELOW_VERSION, SKIP_VERSION_CHECK_ENV)

from pcie_a2a.integrations.sglang.dispatcher import (  # noqa: E402
    OUTPUT_FORMATS,
    PcieA2ADispatcher,
)
from pcie_a2a.integrations.sglang.plugin import attach_int4_experts, register  # noqa: E402
from pcie_a2a.integrations.sglang.state import A2A_ALIAS, A2A_NAME, is_active  # noqa: E402

__all__ = [
    "A2A_ALIAS",
    "A2A_NAME",
    "OUTPUT_FORMATS",
    "SGLANG_VERSION",
    "PcieA2ADispatcher",
    "attach_int4_experts",
    "is_active",
    "register",
]
