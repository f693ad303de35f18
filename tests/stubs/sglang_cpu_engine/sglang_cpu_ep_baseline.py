"""Test-only SGLang plugin for the ``--moe-a2a-backend none`` baseline of
tests/framework/test_sglang_server.py (its entry point is written by that test only).

SGLang 0.5.23's own EP on CPU crashes: its StandardDispatcher hands ``moe_forward_native``
local ids with -1 for experts held elsewhere, which that loop scatters out of bounds. This
wraps the loop with pcie_a2a's own fix (``integrations/sglang/cpu.py``: a distinct unused
local expert with weight 0 per dropped slot) for every backend, so the baseline runs.
"""

from __future__ import annotations


def _wrap(original, layer, x, topk_output, moe_runner_config):
    from pcie_a2a.integrations.sglang.cpu import fill_dropped_slots

    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    ids, weights = fill_dropped_slots(
        topk_output.topk_ids, topk_output.topk_weights, int(layer.w13_weight.shape[0])
    )
    out = topk_output._replace(topk_ids=ids, topk_weights=weights)
    return original(layer, x, out, moe_runner_config)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.layers.moe.fused_moe_native.moe_forward_native", _wrap, HookType.AROUND
    )
