"""What every SGLang hook module needs to know: our backend's names and whether it is selected.

It lives apart from ``plugin.py`` so that the hook modules (dispatcher, int4, models, eplb,
cpu) depend on this small module instead of on the plugin that imports them.
"""

from __future__ import annotations

from pcie_a2a import env

A2A_NAME = "customized"
A2A_ALIAS = "pcie"
A2A_NAMES = (A2A_ALIAS, A2A_NAME)


def is_active() -> bool:
    """True when SGLang's a2a backend is ``customized`` (or ``pcie``) and not disabled."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    return env.sglang_enabled() and get_moe_a2a_backend().is_customized()
