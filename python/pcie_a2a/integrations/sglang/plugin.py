"""The SGLang plugin: what ``register()`` (the ``sglang.srt.plugins`` entry point) changes.

SGLang 0.5.2x has no registry of a2a backends, but its ``MoeA2ABackend`` enum has an unused
``CUSTOMIZED`` member. The plugin:

1. adds ``pcie`` and ``customized`` to the ``--moe-a2a-backend`` choices and makes
   ``MoeA2ABackend("pcie")`` resolve to ``CUSTOMIZED`` (so ``pcie`` is an alias: SGLang
   itself only ever sees ``customized``);
2. adds both names to the backends whose EP group spans the TP group (``ep_size =
   tp_size``, as for deepep/pplx);
3. wraps ``create_moe_dispatcher`` so the ``customized`` backend builds a
   :class:`PcieA2ADispatcher` (every other backend is untouched);
4. makes ``post_experts_output_is_complete()`` true under our backend (our combine returns
   each token's full sum on its source rank, so models skip the EP/TP all-reduce after the
   MoE), and turns off ``FusedMoE``'s own ``reduce_results`` all-reduce for layers that use
   our dispatcher;
5. registers a fused function for (``customized``, ``marlin``) so SGLang's Marlin runner
   (INT4 GPTQ/AWQ/compressed-tensors MoE) constructs under our backend;
6. makes the shared experts of the validated MoE blocks replicated and refuses any other
   block on our dispatcher (``models.py``);
7. routes the INT4 MoE schemes (compressed-tensors, GPTQ, AWQ) to ``moe_int4_mlp`` with
   their weights converted after loading (``int4.py``);
8. overrides SGLang's ``handle_a2a_moe`` resolution step: launch-time refusals, CUDA graphs
   off, shared-experts fusion off, buffer capacity from the server's limits (``launch.py``);
9. hooks ``GroupCoordinator`` so that, with ``PCIE_A2A_ALLREDUCE=1`` (whatever the a2a
   backend), the TP all-reduce below the crossover runs on ``pcie_a2a.AllReduce``
   (``allreduce.py``); unset, those hooks return at once.

Every MoE hook checks :func:`is_active` first: with another backend selected, or with
``PCIE_A2A_SGLANG=0``, SGLang runs its own code unchanged (the all-reduce hooks of item 9
check ``PCIE_A2A_ALLREDUCE`` instead).
"""

from __future__ import annotations

import inspect
import logging
import typing
from typing import Any

from pcie_a2a.integrations.sglang.state import A2A_ALIAS, A2A_NAME, A2A_NAMES, is_active

logger = logging.getLogger("pcie_a2a.integrations.sglang")

_T_LAYER = "sglang.srt.layers.moe.fused_moe_triton.layer"
_T_UTILS = "sglang.srt.layers.moe.utils"
_registered = False


# ---- hooks (module-level so they are picklable and show up by name in SGLang's logs) ------
def _create_moe_dispatcher(original, *args: Any, **kwargs: Any):
    if not is_active():
        return original(*args, **kwargs)
    from pcie_a2a.integrations.sglang import models
    from pcie_a2a.integrations.sglang.dispatcher import PcieA2ADispatcher

    cfg = kwargs.get("moe_runner_config", args[0] if args else None)
    if cfg is None:
        raise TypeError("create_moe_dispatcher: no moe_runner_config")
    models.check_block_building()
    return PcieA2ADispatcher(cfg)


def _post_experts_output_is_complete(original, *args: Any, **kwargs: Any) -> bool:
    return True if is_active() else original(*args, **kwargs)


def _fused_moe_init(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    from pcie_a2a.integrations.sglang.dispatcher import PcieA2ADispatcher

    dispatcher = getattr(self, "dispatcher", None)
    if isinstance(dispatcher, PcieA2ADispatcher):
        # The combine already returned complete sums: an all-reduce would add the outputs
        # of *different* tokens from other DP ranks (or hang on mismatched sizes).
        self.reduce_results = False
        check_layer(self, dispatcher)
        self.dispatcher.bind_layer(self)  # decode: INT4 layers take the expert-major layout
    return None


def check_layer(layer: Any, dispatcher: Any) -> None:
    """The launch refusals again for one MoE layer as built (a runner backend or scheme
    SGLang picked itself, a format set only in the scheduler's environment), plus the
    INT4 schemes whose weights ``int4.py`` does not convert."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    from pcie_a2a.integrations.sglang import int4, launch

    launch.check_runner_backend(get_moe_runner_backend())
    int4_scheme = int4.check_scheme_hooked(layer)
    factor = None  # off CUDA/MUSA/XPU the model applies it itself, in every format
    if int4.runner_applies_routed_scaling(layer):
        cfg = getattr(layer, "moe_runner_config", None) or dispatcher.moe_runner_config
        factor = getattr(cfg, "routed_scaling_factor", None)
    launch.check_output_format(dispatcher.output_format, factor, int4_scheme)


def _missing_a2a_name(original, cls: Any, value: Any):
    if value == A2A_ALIAS:
        return cls.CUSTOMIZED
    # the registry hands over the plain function behind the classmethod
    return original(value) if inspect.ismethod(original) else original(cls, value)


def attach_int4_experts(layer: Any, experts: Any) -> None:
    """Gives a MoE layer this rank's routed experts in pcie_a2a's packed INT4 layout
    (a :class:`pcie_a2a.quant.PackedInt4Experts` of the *local* experts, on the layer's
    device). Not needed for SGLang's INT4 schemes, whose loaded weights are converted
    automatically (``int4.py``); for layers built some other way."""
    from pcie_a2a.integrations.sglang.int4 import INT4_ATTR
    from pcie_a2a.quant import PackedInt4Experts

    if not isinstance(experts, PackedInt4Experts):
        raise TypeError(f"experts: got {type(experts).__name__}; expected PackedInt4Experts")
    setattr(layer, INT4_ATTR, experts)


def fused_marlin(dispatch_output: Any, quant_info: Any, runner_config: Any):
    """The fused function for (customized, marlin): ``moe_int4_mlp`` on our STANDARD
    output (rows, local expert ids with -1 elsewhere, fp32 weights) with the layer's
    packed experts. SGLang's own Marlin kernel is never given our rows: it has not run
    with rows whose ids are already local."""
    from sglang.srt.layers.moe.token_dispatcher.base import DispatchOutputChecker

    from pcie_a2a.integrations.sglang.int4 import INT4_ATTR, run_rows

    if not DispatchOutputChecker.format_is_standard(dispatch_output):
        raise TypeError(
            "pcie_a2a: the Marlin runner needs the STANDARD dispatch format; unset "
            "PCIE_A2A_SGLANG_FORMAT or set it to 'standard'"
        )
    layer = getattr(runner_config, "layer", None)
    if getattr(layer, INT4_ATTR, None) is None:
        raise RuntimeError(
            "pcie_a2a: an INT4 (Marlin) MoE layer reached the runner without pcie_a2a's "
            "packed experts; its quantization scheme is not one the plugin converts "
            "(compressed-tensors WNA16, GPTQ-Marlin, AWQ-Marlin)"
        )
    if getattr(layer, "moe_runner_config", None) is None:
        layer.moe_runner_config = runner_config
    return run_rows(layer, dispatch_output)


# ---- data patches (no hook API for module constants and CLI metadata) -----------------
def _patch_cli_choices() -> list[str]:
    """Appends our names to every ``Arg.choices`` list attached to ``moe_a2a_backend``."""
    from sglang.srt.server_args import ServerArgs

    patched = []
    owners: list[Any] = [ServerArgs]
    try:
        from sglang.srt.arg_groups.fields.exec_ import ExecMoe

        owners.append(ExecMoe)
    except ImportError:  # pragma: no cover - older layouts keep the field on ServerArgs only
        pass
    for owner in owners:
        try:
            hints = typing.get_type_hints(owner, include_extras=True)
        except Exception:
            hints = getattr(owner, "__annotations__", {})
        hint = hints.get("moe_a2a_backend")
        for meta in getattr(hint, "__metadata__", ()):
            choices = getattr(meta, "choices", None)
            if isinstance(choices, list):
                for name in A2A_NAMES:
                    if name not in choices:
                        choices.append(name)
                patched.append(owner.__name__)
    if not patched:
        raise RuntimeError(
            "pcie_a2a: could not find the --moe-a2a-backend choices in this SGLang; "
            "it is not a supported version"
        )
    return patched


def _patch_ep_spanning() -> None:
    from sglang.srt.arg_groups import overrides

    current = overrides._A2A_EP_SPANNING_BACKENDS
    if not set(A2A_NAMES) <= set(current):
        overrides._A2A_EP_SPANNING_BACKENDS = frozenset(current) | frozenset(A2A_NAMES)


def _register_marlin() -> None:
    from sglang.srt.layers.moe.moe_runner.base import FusedOpPool

    if FusedOpPool.get_fused_func(A2A_NAME, "marlin") is None:
        FusedOpPool.register_fused_func(A2A_NAME, "marlin", fused_marlin)


def register() -> None:
    """Entry point (``sglang.srt.plugins``). Idempotent; SGLang applies the hooks after."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from pcie_a2a.integrations.sglang import SGLANG_VERSION

    _patch_cli_choices()
    _patch_ep_spanning()
    _register_marlin()
    HookRegistry.register(f"{_T_UTILS}.MoeA2ABackend._missing_", _missing_a2a_name, HookType.AROUND)
    HookRegistry.register(
        f"{_T_LAYER}.create_moe_dispatcher", _create_moe_dispatcher, HookType.AROUND
    )
    HookRegistry.register(
        f"{_T_UTILS}.post_experts_output_is_complete",
        _post_experts_output_is_complete,
        HookType.AROUND,
    )
    HookRegistry.register(f"{_T_LAYER}.FusedMoE.__init__", _fused_moe_init, HookType.AFTER)
    from pcie_a2a.integrations.sglang import allreduce, int4, launch, models

    for target, hook in models.hook_targets() + int4.hook_targets():
        HookRegistry.register(target, hook, HookType.AROUND)
    allreduce.register_hooks(HookRegistry, HookType)  # inert unless PCIE_A2A_ALLREDUCE=1
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook("handle_a2a_moe")(launch.handle_a2a_moe)
    from pcie_a2a.integrations.sglang.eplb import register_eplb  # EPLB: docs/balance.md

    register_eplb()
    from pcie_a2a.integrations.sglang import cpu

    cpu.patch_torch_native_backend()  # SGLang's CPU engine only (cpu.py)
    for target, hook in cpu.HOOK_TARGETS:
        HookRegistry.register(target, hook, HookType.AROUND)
    _registered = True
    logger.info(
        "pcie_a2a SGLang backend registered (sglang %s): select it with "
        "--moe-a2a-backend %s (alias of %s)",
        SGLANG_VERSION,
        A2A_ALIAS,
        A2A_NAME,
    )
