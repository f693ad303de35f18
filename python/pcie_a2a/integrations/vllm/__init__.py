"""vLLM backend: a Standard-format modular-kernel prepare/finalize on pcie_a2a.

Loaded through the entry point group ``vllm.general_plugins`` (name ``pcie_a2a``, object
``pcie_a2a.integrations.vllm:register``) and selected with the environment variable
``PCIE_A2A_VLLM=1`` together with ``--enable-expert-parallel --data-parallel-size N``
(vLLM's ``--all2all-backend`` is a closed Literal, so it cannot take a new name).

Importing this package imports nothing from vLLM, so that the entry point can never fail
to load; ``register()`` checks ``vllm.__version__`` (>=0.32,<0.34) and turns any failure
into a logged warning. Touching :class:`PcieA2APrepareAndFinalize` or ``VLLM_VERSION``
imports vLLM and runs the same version check (raising ImportError). See docs/vllm.md.
"""

from __future__ import annotations

from pcie_a2a.integrations.vllm.plugin import (
    BELOW_VERSION,
    ENABLE_ENV,
    MIN_VERSION,
    SKIP_VERSION_CHECK_ENV,
    TESTED_VERSIONS,
    is_enabled,
    register,
)

__all__ = [
    "BELOW_VERSION",
    "ENABLE_ENV",
    "MIN_VERSION",
    "SKIP_VERSION_CHECK_ENV",
    "TESTED_VERSIONS",
    "VLLM_VERSION",
    "PcieA2APrepareAndFinalize",
    "is_enabled",
    "register",
]


def __getattr__(name: str):
    if name == "VLLM_VERSION":
        from pcie_a2a.integrations.vllm.plugin import vllm_version

        return vllm_version()
    if name == "PcieA2APrepareAndFinalize":
        from pcie_a2a.integrations.vllm.plugin import vllm_version

        vllm_version()
        from pcie_a2a.integrations.vllm.prepare_finalize import PcieA2APrepareAndFinalize

        return PcieA2APrepareAndFinalize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
