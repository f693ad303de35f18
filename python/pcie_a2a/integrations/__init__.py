"""Drop-in expert-parallel backends for serving frameworks.

``pcie_a2a.integrations.sglang`` (entry point group ``sglang.srt.plugins``) and
``pcie_a2a.integrations.vllm`` (group ``vllm.general_plugins``). Nothing here is imported by
``import pcie_a2a``; each subpackage imports its framework and checks its version when it is
imported itself. See docs/sglang.md and docs/vllm.md.
"""
