"""Test-only stand-in for ``sgl_kernel`` (SGLang's kernel package), for the CPU-engine server
test (tests/framework/test_sglang_server.py puts tests/stubs/sglang_cpu_engine on the
server's PYTHONPATH; nothing else does).

Under ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports a few names from ``sgl_kernel`` at
module level (listed in :data:`NAMES`, with the importing module), but the CPU build of the
package is not on PyPI. On CPUs without AMX the server calls none of them for the models the
test serves, so each is a function that raises when called: a code path that reaches one
fails loudly with its name instead of computing anything. Every other name (and every
submodule, e.g. ``sgl_kernel.scalar_type``) is missing, so SGLang's own ``ImportError``
fallbacks still apply.
"""

from __future__ import annotations

__version__ = "0.0.0+pcie_a2a_stub"
PCIE_A2A_STUB = True

#: name -> the SGLang 0.5.23 module that imports it at module level on the CPU engine
NAMES = {
    "fill_bonus_tokens_cpu": "sglang/kernels/ops/speculative/eagle.py",
    "fill_accept_out_cache_loc_cpu": "sglang/kernels/ops/speculative/eagle.py",
    "assign_extend_cache_locs_cpu": "sglang/kernels/ops/speculative/cache_locs.py",
    "assign_draft_cache_locs_contiguous_cpu": "sglang/kernels/ops/speculative/cache_locs.py",
    "verify_tree_greedy_cpu": "sglang/kernels/ops/speculative/spec_tree.py",
    "build_tree_kernel_efficient_cpu": "sglang/kernels/ops/speculative/spec_tree.py",
    "assign_req_to_token_pool_cpu": "sglang/srt/mem_cache/allocation.py",
    "copy_all_layer_kv_cache_cpu": "sglang/kernels/ops/kvcache/cache_move.py",
}


def _unavailable(name: str):
    def call(*_args, **_kwargs):
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but sgl_kernel is a test stand-in here "
            "(tests/stubs/sglang_cpu_engine): its CPU build is not installed"
        )

    call.__name__ = call.__qualname__ = name
    return call


globals().update({name: _unavailable(name) for name in NAMES})
