"""Where the plan's topology comes from: a file ``pcie-a2a topo --from`` reads, the name of
a fixture dump in a source checkout, this machine, or (when none of these has GPUs) a
synthetic box, which the output then says it assumed."""

from __future__ import annotations

from pathlib import Path

from pcie_a2a.topology import Gpu, NumaNode, P2PStatus, Probe, Topology, TopologyError, current
from pcie_a2a.topology.sources import load_with_probe

_CHECKOUT = Path(__file__).resolve().parents[3]  # a source checkout (python/pcie_a2a/...)


def _fixture_dirs() -> tuple[Path, ...]:
    """Where fixture names resolve: beside this source checkout, or, for an installed
    package, beside the checkout the command runs in (the current directory)."""
    roots = dict.fromkeys((_CHECKOUT, Path.cwd().resolve()))
    return tuple(
        d
        for root in roots
        for d in (
            root.parent / "shared" / "fixtures" / "topology",
            root / "tests" / "fixtures" / "topology",
        )
    )


def synthetic_topology(n: int, gen: int) -> Topology:
    """``n`` GPUs on one NUMA node, every pair NODE-class with P2P (an assumption)."""
    sup = P2PStatus.SUPPORTED
    return Topology(
        gpus=tuple(Gpu(i, numa_node=0, link_gen=gen, link_width=16) for i in range(n)),
        classes=tuple(tuple("X" if i == j else "NODE" for j in range(n)) for i in range(n)),
        p2p=tuple(tuple(P2PStatus.UNKNOWN if i == j else sup for j in range(n)) for i in range(n)),
        numa_nodes=(NumaNode(0, 0),),
        source=f"synthetic: {n} GPUs, every pair NODE with P2P, one NUMA node",
    )


def fixture_names() -> list[str]:
    for d in _fixture_dirs():
        if d.is_dir():
            return sorted({p.name.split(".")[0] for p in d.glob("*.txt")})
    return []


def _fixture(name: str) -> Path | None:
    for d in _fixture_dirs():
        if not d.is_dir():
            continue
        for suffix in (
            ".topo.txt",
            ".nccl-topo.xml.txt",
            ".topo-p2p.txt",
            ".p2p.txt",
            ".nccl-paths.txt",
        ):
            p = d / f"{name}{suffix}"
            if p.is_file():
                return p
    return None


def resolve(arg: str | None, num_gpus: int | None, gen: int) -> tuple[Topology, Probe | None, str]:
    """(topology, measurements the file carries, a note on where it came from)."""
    if arg:
        path = Path(arg)
        if not path.is_file():
            fx = _fixture(arg)
            if fx is None:
                names = fixture_names()
                raise ValueError(
                    f"--topo: got {arg!r}, which is neither a file nor a fixture name"
                    + (f"; fixtures: {', '.join(names)}" if names else "")
                )
            path = fx
        try:
            topo, probe = load_with_probe(path)
        except (TopologyError, OSError) as exc:
            raise ValueError(f"--topo {arg}: {exc}") from None
        return topo, probe, f"topology from {path}"
    try:
        live = current()
    except (TopologyError, OSError, ValueError):
        live = None
    if live is not None and live.num_gpus >= 2:
        return live, None, f"topology of this machine ({live.source or 'sysfs'})"
    n = num_gpus or 8
    return (
        synthetic_topology(n, gen),
        None,
        f"no topology given and none found on this machine: assumed {n} GPUs, every pair "
        "NODE-class P2P on one NUMA node (pass --topo FILE for the real box)",
    )


def probe_companion(name: str) -> Path | None:
    """The measured-pairs dump (``<name>.p2p.txt``) that sits beside a fixture's topology."""
    for d in _fixture_dirs():
        p = d / f"{name}.p2p.txt"
        if p.is_file() and _fixture(name) != p:
            return p
    return None


def companion_of(path: Path) -> Path | None:
    """The measured-pairs dump beside a topology file, whatever it was named by: the same
    stem (``<name>.topo.txt`` -> ``<name>.p2p.txt``) in the same directory."""
    stem = path.name.split(".")[0]
    p = path.with_name(f"{stem}.p2p.txt")
    return p if p.is_file() and p.resolve() != path.resolve() else None
