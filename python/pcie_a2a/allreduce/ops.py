"""The torch.library ops behind :class:`pcie_a2a.AllReduce` and their fake kernels.

``pcie_a2a::all_reduce(x, handle, residual?) -> Tensor``,
``pcie_a2a::all_reduce_out(x, out!, handle, residual?)`` and
``pcie_a2a::all_reduce_rmsnorm(x, handle, residual?, weight, eps) -> (Tensor, Tensor)``.
``handle`` names the communicator (an int, so the op schema stays plain); the fake kernels
only give shapes, so ``torch.compile`` traces through them without communicating.
"""

from __future__ import annotations

import torch

from pcie_a2a.allreduce.communicator import lookup


@torch.library.custom_op("pcie_a2a::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, handle: int, residual: torch.Tensor | None) -> torch.Tensor:
    return lookup(handle)._run(x, None, residual)


@all_reduce.register_fake
def _all_reduce_fake(x, handle, residual):
    return torch.empty_like(x)


@torch.library.custom_op("pcie_a2a::all_reduce_out", mutates_args=("out",))
def all_reduce_out(
    x: torch.Tensor, out: torch.Tensor, handle: int, residual: torch.Tensor | None
) -> None:
    lookup(handle)._run(x, out, residual)


@all_reduce_out.register_fake
def _all_reduce_out_fake(x, out, handle, residual):
    return None


@torch.library.custom_op("pcie_a2a::all_reduce_rmsnorm", mutates_args=())
def all_reduce_rmsnorm(
    x: torch.Tensor, handle: int, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return lookup(handle)._run_rmsnorm(x, residual, weight, eps)


@all_reduce_rmsnorm.register_fake
def _all_reduce_rmsnorm_fake(x, handle, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)
