"""Rank 0's share of the bootstrap (the topology planner's decisions for the group's
devices) and each sender's row of the pair plan (CUDA peer access)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pcie_a2a.transport.cuda.common import P2P, STAGED

# Live discovery walks sysfs and asks NVML: seconds on a big box, for every Buffer of every
# layer. The machine does not change under a process; the knobs that steer the plan may
# (tests set them), so they are part of the key.
_PLANS: dict[tuple, tuple[Any, str]] = {}


def _mtime(path: str | None) -> int | None:
    try:
        return os.stat(path).st_mtime_ns if path else None
    except OSError:
        return None


def _plan_key(bus_ids: list[str | None]) -> tuple:
    from pcie_a2a import env

    # a topology or probe file rewritten in this process is read again
    files = tuple((f, _mtime(f)) for f in (env.topo_file(), env.probe_file()))
    knobs = (env.probe_cache(), env.p2p(), env.p2p_level(), env.direction(), env.engine(),
             env.schedule(), repr(env.pair_overrides()))  # fmt: skip
    return (tuple(bus_ids), files, knobs)


def clear_plan_cache() -> None:
    """Forgets the plans :func:`topology_rank_transfers` kept (the next Buffer discovers again)."""
    _PLANS.clear()


def topology_rank_transfers(bus_ids: list[str | None]) -> tuple[Any, str]:
    """The planner's decisions for these ranks (:class:`pcie_a2a.topology.ranks.RankTransfers`)
    from PCIE_A2A_TOPO_FILE or the live machine, and a line saying where they come from;
    (None, why) when there is no usable topology (then CUDA peer access decides). Kept per
    process for the same devices and planner knobs; an exception is not kept."""
    from pcie_a2a.topology import TopologyError, TransferOptions, plan_transfers
    from pcie_a2a.topology.ranks import rank_transfers
    from pcie_a2a.topology.sources import current_with_probe

    if None in bus_ids:
        return None, "no topology plan: torch does not report the devices' PCI addresses"
    key = _plan_key(bus_ids)
    if key in _PLANS:
        return _PLANS[key]
    try:
        topo, probe = current_with_probe()
        rp = rank_transfers(
            topo, plan_transfers(topo, options=TransferOptions.from_env(probe=probe)), bus_ids
        )
        out = rp, f"topology plan from {topo.source}, ranks matched {rp.how}"
    except (TopologyError, ValueError, OSError) as exc:
        out = None, f"no topology plan ({exc}); pairs follow CUDA peer access"
    _PLANS[key] = out
    return out


def plan_on_rank0(explicit: bool, bus_ids: list[str | None]) -> tuple[Any, str, str | None]:
    """Rank 0's share of the bootstrap: (plan, note, error). Every exception is caught and
    travels through the next gather as the error, so every rank raises it instead of the
    other ranks waiting in the gather for the process group's timeout."""
    if explicit:
        return None, "explicit plan", None
    try:
        from pcie_a2a.transport import cuda as pkg

        rp, note = pkg.topology_rank_transfers(bus_ids)
    except Exception as exc:  # travels to every rank
        return None, "", f"{type(exc).__name__}: {exc}"
    return rp, note, None


def outgoing_pairs(
    rank: int,
    uuids: list[str],
    p2p: bool | None,
    visible: list[str],
    can_access: Callable[[int, int], bool],
) -> list[int]:
    """How `rank` reaches every rank (its row of the pair plan): P2P or STAGED.

    ``uuids[r]``: rank r's device (:func:`device_uuid`); ``visible``: the UUIDs of the
    devices this process sees, by local index; ``can_access(i, j)``: CUDA peer access
    between local indices. ``p2p`` is PCIE_A2A_P2P: False stages every pair through host
    memory, True forces P2P; None uses P2P for ranks on the same device (IPC) and where
    CUDA reports peer access. A peer whose device this process cannot see (one GPU per
    process through CUDA_VISIBLE_DEVICES) cannot be opened through IPC: staged.
    """
    mine = uuids[rank]
    row = []
    for d, theirs in enumerate(uuids):
        if d == rank or (theirs == mine and p2p is not False):
            row.append(P2P)
        elif p2p is not None:
            row.append(P2P if p2p else STAGED)
        elif mine in visible and theirs in visible:
            ok = can_access(visible.index(mine), visible.index(theirs))
            row.append(P2P if ok else STAGED)
        else:
            row.append(STAGED)
    return row
