"""SGLang's EPLB with pcie_a2a: our balancer as an EPLB algorithm, and the replica each rank
dispatches to chosen on the PCIe tree.

What SGLang already does right under ``--moe-a2a-backend pcie``: its top-k turns logical
expert ids into *physical* ones (``--ep-num-redundant-experts``, ``--init-expert-location``,
``--enable-eplb``), the MoE layers are built with ``num_experts`` = physical experts, and
our dispatcher's Buffer places physical expert ``p`` on EP rank ``p // local`` at local
index ``p % local`` (contiguous blocks), exactly SGLang's layout. So EPLB placements, static
files and SGLang's own weight moves (``expert_location_updater``) work unchanged.

What this module adds (``register_eplb``, called by the plugin):

* ``--eplb-algorithm pcie_a2a``: ``eplb_algorithms.compute_algorithm`` returns our marker
  for that name and ``eplb_algorithms.rebalance_experts`` runs :func:`pcie_a2a.balance.
  balance` for it (SGLang's own algorithms are untouched). The islands are this box's
  topology (``PCIE_A2A_TOPO_FILE`` or live discovery) with EP rank ``r`` on GPU ``r`` of
  the node, or ``PCIE_A2A_BALANCE_GPUS``; with several nodes each node is one more island
  level above the box's. The current placement, when SGLang has one, makes moving experts
  cost (the move penalty).
* static dispatch (``--ep-dispatch-algorithm static``, SGLang's default under an a2a
  backend) picks the nearest replica on the PCIe tree instead of "same GPU, else a seeded
  random one": ``compute_logical_to_rank_dispatch_physical_map`` is replaced under our
  backend. SGLang's map has one replica per (rank, expert), so where several replicas are
  equally near, the source ranks that see the same set take them in turn.

vLLM has no such hook (its EPLB policy is fixed to "default"): docs/vllm.md.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger("pcie_a2a.integrations.sglang")

ALGORITHM = "pcie_a2a"
_T = "sglang.srt.eplb"


class _Ours:
    """What ``compute_algorithm`` returns for ``--eplb-algorithm pcie_a2a``."""

    name = ALGORITHM
    value = ALGORITHM

    def __repr__(self) -> str:
        return "EplbAlgorithm.pcie_a2a"


OURS = _Ours()


def sglang_islands(world: int, num_nodes: int = 1):
    """Islands of the EP group: the box topology per node, nodes above."""
    from pcie_a2a import env
    from pcie_a2a.balance import Islands
    from pcie_a2a.topology import TransferOptions, current

    if world % num_nodes:
        raise ValueError(f"{world} EP ranks do not split over {num_nodes} nodes")
    per_node = world // num_nodes
    try:
        topo = current()
    except Exception as exc:  # no sysfs/GPU view: balance as if every rank were its own island
        logger.warning("pcie_a2a EPLB: no topology (%s); balancing without islands", exc)
        return Islands.flat(world)
    gpus = env.balance_gpus() or list(range(per_node))
    if len(gpus) != per_node or any(not 0 <= g < topo.num_gpus for g in gpus):
        logger.warning(
            "pcie_a2a EPLB: %d ranks per node but GPUs %s of a %d-GPU topology; balancing "
            "without islands (set PCIE_A2A_BALANCE_GPUS)",
            per_node,
            gpus,
            topo.num_gpus,
        )
        return Islands.flat(world)
    box = Islands.from_topology(topo, gpus, TransferOptions.from_env())
    if num_nodes == 1:
        return box
    return Islands.from_paths(
        [(f"node{r // per_node}", *box.paths[r % per_node]) for r in range(world)],
        name=f"{num_nodes} x {box.name}",
    )


def rebalance(
    tokens_per_expert: Any,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_nodes: int = 1,
    islands: Any = None,
    previous: Any = None,
):
    """SGLang's ``rebalance_experts`` contract with our balancer: ``tokens_per_expert``
    ``[..., layers, logical]`` -> (``physical_to_logical_map [layers, physical]``,
    ``logical_to_all_physical_map [layers, logical, X]`` (-1 padded), ``expert_count
    [layers, logical]``), int64 tensors on the input's device."""
    import torch

    from pcie_a2a.balance import Options, balance

    t = torch.as_tensor(tokens_per_expert)
    loads = t.reshape(-1, *t.shape[-2:]).double().sum(0).cpu().numpy()
    n_layers, e_n = loads.shape
    world = num_physical_experts // num_local_physical_experts
    isl = islands if islands is not None else sglang_islands(world, num_nodes)
    opt = Options(redundant=num_physical_experts - e_n)
    prev = None
    if previous is not None:
        p = np.asarray(torch.as_tensor(previous).cpu(), dtype=np.int64)
        if p.shape == (n_layers, num_physical_experts):
            prev = [row.reshape(world, -1) for row in p]
    results = balance(loads, isl, opt, prev)
    phys = np.stack([r.slots.reshape(-1) for r in results])
    count = np.stack([np.bincount(row, minlength=e_n) for row in phys])
    x = int(count.max())
    log2phy = np.full((n_layers, e_n, x), -1, dtype=np.int64)
    for layer, row in enumerate(phys):
        fill = np.zeros(e_n, dtype=np.int64)
        for p, e in enumerate(row):
            log2phy[layer, e, fill[e]] = p
            fill[e] += 1
    dev = t.device
    return (
        torch.from_numpy(phys).to(dev),
        torch.from_numpy(log2phy).to(dev),
        torch.from_numpy(count).to(dev),
    )


def dispatch_map(
    logical_to_all_physical_map: Any,
    ep_size: int,
    num_physical_experts: int,
    ep_rank: int,
    islands=None,
):
    """``[layers, logical]`` physical expert each logical expert's tokens from ``ep_rank``
    go to: the nearest replica on the PCIe tree; equally near ones shared out in turn
    among the source ranks that see the same set."""
    import torch

    m = torch.as_tensor(logical_to_all_physical_map)
    a = m.cpu().numpy()
    local = num_physical_experts // ep_size
    isl = islands if islands is not None else sglang_islands(ep_size)
    near = isl.nearness()
    n_layers, e_n, _ = a.shape
    out = np.full((n_layers, e_n), -1, dtype=np.int64)
    for layer in range(n_layers):
        for e in range(e_n):
            cand = [int(p) for p in a[layer, e] if p >= 0]
            turn: dict[tuple[int, ...], int] = {}
            for src in range(ep_rank + 1):
                score = [near[src, p // local] for p in cand]
                best = tuple(p for p, s in zip(cand, score) if s == max(score))
                k = turn.get(best, 0)
                turn[best] = k + 1
                if src == ep_rank:
                    out[layer, e] = best[k % len(best)]
    return torch.from_numpy(out).to(dtype=m.dtype, device=m.device)


# ---- hooks ------------------------------------------------------------------------------------
def _compute_algorithm(original, raw_algorithm, *args: Any, **kwargs: Any):
    if raw_algorithm == ALGORITHM:
        return OURS
    return original(raw_algorithm, *args, **kwargs)


def _rebalance_experts(original, *args: Any, **kwargs: Any):
    names = (
        "tokens_per_expert",
        "num_physical_experts",
        "num_local_physical_experts",
        "num_groups",
        "num_nodes",
        "algorithm",
    )
    bound = dict(zip(names, args)) | kwargs
    if bound.get("algorithm") is not OURS:
        return original(*args, **kwargs)
    previous = None
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        current = get_global_expert_location_metadata()
        previous = None if current is None else current.physical_to_logical_map_cpu
    except Exception:  # no runtime context (offline use): balance from scratch
        previous = None
    return rebalance(
        bound["tokens_per_expert"],
        bound["num_physical_experts"],
        bound["num_local_physical_experts"],
        bound.get("num_nodes", 1) or 1,
        previous=previous,
    )


def _dispatch_map(original, *args: Any, **kwargs: Any):
    from pcie_a2a.integrations.sglang.state import is_active

    if not is_active():
        return original(*args, **kwargs)
    names = ("logical_to_all_physical_map", "ep_size", "num_physical_experts", "ep_rank")
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    try:
        from sglang.srt.runtime_context import get_parallel

        nnodes = int(getattr(get_parallel(), "nnodes", 1) or 1)
    except Exception:  # parallel state not published (offline use)
        nnodes = 1
    isl = sglang_islands(bound["ep_size"], nnodes)
    return dispatch_map(
        bound["logical_to_all_physical_map"],
        bound["ep_size"],
        bound["num_physical_experts"],
        bound["ep_rank"],
        isl,
    )


def register_eplb() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        f"{_T}.eplb_algorithms.compute_algorithm", _compute_algorithm, HookType.AROUND
    )
    HookRegistry.register(
        f"{_T}.eplb_algorithms.rebalance_experts", _rebalance_experts, HookType.AROUND
    )
    HookRegistry.register(
        f"{_T}.expert_location.compute_logical_to_rank_dispatch_physical_map",
        _dispatch_map,
        HookType.AROUND,
    )
