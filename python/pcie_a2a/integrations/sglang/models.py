"""Which SGLang MoE models run right on the pcie backend, and the shared-expert fix.

Why this exists: under any a2a backend SGLang's layer boundary treats the MoE block's
output as complete (each rank computes its own rows, ``is_moe_input_scattered_across_
dp_ranks()``), so nothing sums it over TP afterwards. A shared expert built TP-sharded
then contributes only this rank's slice of its intermediate dimension to each token:
silently wrong numbers. SGLang builds it replicated only for the a2a backends it lists
by name, and ``customized`` is not among them. Here:

* ``DeepseekV2MoE`` (DeepSeek-V2/V3, Kimi K2/K2.5 through ``DeepseekV3ForCausalLM``): built
  with SGLang's own switch ``SGLANG_SHARED_EXPERT_TP1`` set for the duration of its
  ``__init__``, which also makes the block add the replicated output itself.
* ``Qwen2MoeSparseMoeBlock`` and ``Glm4MoeSparseMoeBlock``: the MLP class each builds its
  shared expert from gets ``parallel_group="replicated"`` while the block is being built
  (those blocks add the shared output to the routed one, complete either way).
* ``Qwen3MoeSparseMoeBlock`` has no shared expert; it only asks the predicates the plugin
  already answers.

Any other class that builds a ``FusedMoE`` on our dispatcher is refused when the layer
is constructed, with its name (:func:`check_block_building`); at launch the model's
architecture is checked against :data:`VALIDATED_ARCHITECTURES` (see ``launch.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from typing import Any

#: MoE block classes whose shared-expert handling under the pcie backend was read
#: against SGLang 0.5.23 and is tested against that version's blocks, mapped
#: to the MLP class their shared expert is built from (None: handled otherwise).
VALIDATED_BLOCKS: dict[str, str | None] = {
    "sglang.srt.models.deepseek_v2.DeepseekV2MoE": None,
    "sglang.srt.models.qwen2_moe.Qwen2MoeSparseMoeBlock": "sglang.srt.models.qwen2_moe.Qwen2MoeMLP",
    "sglang.srt.models.glm4_moe.Glm4MoeSparseMoeBlock": "sglang.srt.models.glm4_moe.Glm4MoeMLP",
    "sglang.srt.models.qwen3_moe.Qwen3MoeSparseMoeBlock": None,
}

#: ``architectures`` entries of a model config that are built only from validated blocks.
VALIDATED_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM",
)

_state = threading.local()  # .blocks: stack of validated block names being built


def _stack() -> list[str]:
    if not hasattr(_state, "blocks"):
        _state.blocks = []
    return _state.blocks


def _active() -> bool:
    from pcie_a2a.integrations.sglang.state import is_active

    return is_active()


def _block_init(original, self, *args: Any, **kwargs: Any):
    """AROUND hook on a validated block's ``__init__``."""
    name = f"{type(self).__module__}.{type(self).__qualname__}"
    if not _active():
        return original(self, *args, **kwargs)
    stack = _stack()
    stack.append(name)
    try:
        if name.endswith(".DeepseekV2MoE"):
            with _shared_expert_tp1():
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)
    finally:
        stack.pop()


@contextlib.contextmanager
def _shared_expert_tp1():
    """SGLang's ``SGLANG_SHARED_EXPERT_TP1`` on for one block's ``__init__``. Not
    SGLang's own ``envs.X.override()``: that one restores nothing when the body raises,
    so a block that failed to build would leave every later block (and a retry after a
    refused configuration) with the switch on."""
    from sglang.srt.environ import envs

    var = envs.SGLANG_SHARED_EXPERT_TP1
    present = var.name in os.environ
    value = os.environ.get(var.name)
    set_to_none = getattr(var, "_set_to_none", False)
    var.set(True)
    try:
        yield
    finally:
        if present:
            os.environ[var.name] = value
        else:
            os.environ.pop(var.name, None)
        if hasattr(var, "_set_to_none"):
            var._set_to_none = set_to_none


def _shared_mlp_init(original, self, *args: Any, **kwargs: Any):
    """AROUND hook on a shared-expert MLP class: replicated inside a validated block."""
    stack = _stack()
    if stack and VALIDATED_BLOCKS.get(stack[-1]) and _active():
        kwargs["parallel_group"] = "replicated"
    return original(self, *args, **kwargs)


def hook_targets() -> list[tuple[str, Any]]:
    """(dotted target, AROUND hook) pairs for SGLang's HookRegistry."""
    targets = []
    for block, mlp in VALIDATED_BLOCKS.items():
        targets.append((f"{block}.__init__", _block_init))
        if mlp:
            targets.append((f"{mlp}.__init__", _shared_mlp_init))
    return targets


def _enclosing_builder() -> str:
    """The class whose ``__init__`` is building the current FusedMoE (for messages)."""
    for frame in inspect.stack(context=0)[2:]:
        if frame.function != "__init__":
            continue
        obj = frame.frame.f_locals.get("self")
        if obj is None:
            continue
        cls = type(obj)
        if any(c.__name__ == "FusedMoE" for c in cls.__mro__):
            continue
        return f"{cls.__module__}.{cls.__qualname__}"
    return "<unknown caller>"


def check_block_building() -> None:
    """Called when SGLang asks for a dispatcher under our backend: refuses unless the
    MoE layer belongs to a validated block whose hook is in place."""
    stack = _stack()
    if stack:
        return
    builder = _enclosing_builder()
    validated = ", ".join(b.rsplit(".", 1)[1] for b in VALIDATED_BLOCKS)
    raise ValueError(
        f"pcie_a2a: {builder} builds a MoE layer under --moe-a2a-backend pcie, but its "
        "shared-expert and reduction handling under this backend is not validated (SGLang "
        "treats an a2a backend's MoE output as complete; a TP-sharded shared expert would "
        f"be silently wrong). Validated MoE blocks: {validated}. Use one of those models or "
        "another --moe-a2a-backend."
    )


def check_architectures(architectures: list[str] | None) -> None:
    """Launch-time check of the model config's ``architectures``."""
    archs = list(architectures or [])
    if any(a in VALIDATED_ARCHITECTURES for a in archs):
        return
    raise ValueError(
        f"pcie_a2a: model architecture {archs or '<none>'} is not validated with "
        "--moe-a2a-backend pcie (its MoE block's shared experts and output reduction "
        "have not been checked against this backend). Validated architectures: "
        f"{', '.join(VALIDATED_ARCHITECTURES)}."
    )
