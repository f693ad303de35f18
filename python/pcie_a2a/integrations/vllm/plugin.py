"""The vLLM general plugin: routes vLLM's prepare/finalize choice to pcie_a2a.

vLLM 0.33 has no registry for prepare/finalize implementations (vllm-project/vllm#50556
would add one) and ``--all2all-backend`` is a closed Literal. So, when ``PCIE_A2A_VLLM=1``,
``register()`` wraps ``all2all_utils.maybe_make_prepare_finalize`` (and rebinds the name in
every already-imported module that took it with ``from ... import``): for layers whose
parallel config uses all2all kernels (``--enable-expert-parallel`` with
``--data-parallel-size`` > 1) and a modular kernel, it returns
:class:`PcieA2APrepareAndFinalize`; everything else goes to vLLM's own choice. vLLM may load
general plugins several times per process: ``register()`` is idempotent.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

from pcie_a2a import env

# A child of vLLM's logger, so the lines appear in vLLM's log with its handlers.
logger = logging.getLogger("vllm.pcie_a2a")

ENABLE_ENV = "PCIE_A2A_VLLM"
_TARGET_MODULE = "vllm.model_executor.layers.fused_moe.all2all_utils"
_TARGET = "maybe_make_prepare_finalize"


def is_enabled() -> bool:
    return env.vllm_enabled()


def _wrap(original):
    @functools.wraps(original)
    def maybe_make_prepare_finalize(moe: Any, quant_config: Any, *args: Any, **kwargs: Any):
        use_monolithic = kwargs.get("use_monolithic", args[2] if len(args) > 2 else False)
        pc = getattr(moe, "moe_parallel_config", None)
        if (
            is_enabled()
            and pc is not None
            and getattr(pc, "use_all2all_kernels", False)
            and not getattr(pc, "use_passthrough_all2all", False)
        ):
            if use_monolithic:
                logger.warning(
                    "pcie_a2a: this layer's experts need a monolithic prepare/finalize; "
                    "using vLLM's own"
                )
            else:
                from pcie_a2a.integrations.vllm.prepare_finalize import (
                    PcieA2APrepareAndFinalize,
                )

                logger.info("pcie_a2a: using PcieA2APrepareAndFinalize for this MoE layer")
                return PcieA2APrepareAndFinalize.from_moe_config(moe)
        return original(moe, quant_config, *args, **kwargs)

    maybe_make_prepare_finalize.__pcie_a2a__ = True
    return maybe_make_prepare_finalize


def register() -> None:
    """Entry point (``vllm.general_plugins``)."""
    import importlib

    from pcie_a2a.integrations.vllm import VLLM_VERSION

    mod = importlib.import_module(_TARGET_MODULE)
    current = getattr(mod, _TARGET)
    if getattr(current, "__pcie_a2a__", False):
        return
    wrapped = _wrap(current)
    setattr(mod, _TARGET, wrapped)
    rebound = 0
    for name, other in list(sys.modules.items()):
        if other is None or other is mod or not name.startswith("vllm"):
            continue
        if getattr(other, _TARGET, None) is current:
            setattr(other, _TARGET, wrapped)
            rebound += 1
    logger.info(
        "pcie_a2a vLLM plugin registered (vllm %s, %s=%s): prepare/finalize hook on %s "
        "(+%d imported modules)",
        VLLM_VERSION,
        ENABLE_ENV,
        int(env.vllm_enabled()),
        _TARGET,
        rebound,
    )
