"""The per-machine probe cache: a probe is kept under a fingerprint of the machine (GPU
UUIDs, PCI bus ids, driver version) in the user's cache directory
(``$XDG_CACHE_HOME/pcie_a2a`` or ``~/.cache/pcie_a2a``, :func:`pcie_a2a.env.cache_dir`), and
picked up when planning on that machine (:func:`.sources.current_with_probe`, which the
CUDA transport's ``topology_rank_transfers`` uses). A different GPU, a moved card or a driver
update changes the fingerprint, so a stale probe is never applied. ``PCIE_A2A_PROBE_CACHE=0``
turns the cache off; ``PCIE_A2A_PROBE_FILE`` names a recorded probe instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from .. import env
from .errors import TopologyError
from .model import normalise_bus_id
from .probe import GpuIdentity, Probe


def fingerprint(gpus: Sequence[GpuIdentity], driver: str | None) -> str:
    """16 hex digits naming the machine: its GPUs (bus id, UUID; in bus id order, so the
    device order of the probing process does not matter) and the driver version."""
    items = sorted((normalise_bus_id(g.bus_id or ""), g.uuid or "") for g in gpus)
    doc = json.dumps({"gpus": items, "driver": driver or ""}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def cache_path(fp: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir if cache_dir is not None else env.cache_dir()) / f"probe-{fp}.json"


def save(probe: Probe, cache_dir: str | os.PathLike | None = None) -> Path:
    """Writes `probe` under its fingerprint (atomically: a reader never sees half a file)."""
    if not probe.fingerprint:
        raise ValueError("probe.fingerprint: got None, expected the machine's fingerprint")
    path = cache_path(probe.fingerprint, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(probe.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def lookup(fp: str, cache_dir: str | os.PathLike | None = None) -> Probe | None:
    """The cached probe of fingerprint `fp`, None when there is none. A damaged file is a
    RuntimeWarning and None (planning goes on without it), never an error."""
    path = cache_path(fp, cache_dir)
    if not path.is_file():
        return None
    try:
        probe = Probe.from_json(path.read_text(encoding="utf-8"), str(path))
    except (OSError, TopologyError) as exc:
        warnings.warn(f"ignoring the cached probe {path}: {exc}", RuntimeWarning, stacklevel=2)
        return None
    if probe.fingerprint != fp:
        warnings.warn(
            f"ignoring the cached probe {path}: it records fingerprint {probe.fingerprint}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return probe


def machine_identity(
    bus_ids: Sequence[str], proc_root: str | os.PathLike = "/proc"
) -> tuple[tuple[GpuIdentity, ...], str | None] | None:
    """This machine's GPUs (bus ids as given, UUIDs from NVML) and driver version, None
    when NVML cannot name them (then no fingerprint, no cache)."""
    from .live import driver_version, nvml_identity

    if not bus_ids:
        return None
    info = nvml_identity(list(bus_ids))
    if info is None or None in info[0]:
        return None
    uuids, driver = info
    gpus = tuple(
        GpuIdentity(index=k, bus_id=b, uuid=u) for k, (b, u) in enumerate(zip(bus_ids, uuids))
    )
    return gpus, driver or driver_version(proc_root)
