"""Test-only SGLang plugin: MLA models (DeepSeek-V3, Kimi K2) on the CPU engine's
``torch_native`` attention, for tests/framework/test_sglang_server.py (its entry point is
written by that test only, for every server it starts, ``none`` and ``pcie`` alike).

SGLang 0.5.23 picks DeepSeek's attention method per backend name
(``models/deepseek_common/attention_backend_handler.py``); ``torch_native`` has no entry and
falls back to Triton's, which takes the MHA path for a prefill without a cached prefix. That
path runs ``attn_mha`` against the MLA cache's latent rows (kv_lora_rank + rope wide, not the
heads' K), and ``TorchNativeAttnBackend`` fails on the shapes. The absorbed MLA method, which
SGLang itself uses for decode and for prefills with a prefix, works on it. This registers
``torch_native`` -> that method: the attention is the same function in both servers, so
the comparison of ``pcie`` with ``none`` is unaffected.
"""

from __future__ import annotations


def _absorbed_mla(attn, forward_batch):
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _dispatch_mla_subtype,
    )

    return _dispatch_mla_subtype(attn, forward_batch)


def register() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )

    AttentionBackendRegistry.register("torch_native", _absorbed_mla)
