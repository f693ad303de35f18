"""``pcie-a2a balance``: balance expert placements for a box from recorded loads.

Reads ``[layers, experts]`` loads (SGLang's expert-distribution recorder dump or our JSON)
and a topology, balances every selected layer, prints per layer and overall what changes
(max/mean rank load, bytes over the socket link and over switch uplinks, the predicted
time of dispatch + experts + combine, experts moved), and writes our placements JSON and
SGLang's ``--init-expert-location`` file. "Before" is ``--previous`` when given, else
contiguous blocks without replicas. Predictions are the cost model's (docs/balance.md),
not measurements.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ..topology import TopologyError, TransferOptions
from ..topology.sources import current, load
from . import io
from .algorithm import Options, balance
from .cost import GPUS, GemmCost, RowBytes
from .eplb import contiguous
from .evaluate import Metrics, Workload, expected
from .islands import Islands
from .layout import check_slots, from_placement, to_placement


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("balance", help="balance expert placements", description=__doc__)
    p.add_argument("--load", required=True, metavar="FILE", help="loads: SGLang .pt/.json or ours")
    p.add_argument(
        "--topo",
        metavar="FILE",
        help="topology in any format `pcie-a2a topo` reads (default: PCIE_A2A_TOPO_FILE, else "
        "this machine)",
    )
    p.add_argument("--redundant", type=int, default=0, metavar="N", help="extra replicas in all")
    p.add_argument("--layers", metavar="LIST", help="layers to balance, e.g. 0-3,7 (default all)")
    p.add_argument("--ranks", metavar="LIST", help="topology GPU of each rank (default 0..W-1)")
    p.add_argument("--world", type=int, metavar="W", help="EP ranks (default: GPUs in --topo)")
    p.add_argument("--tokens", type=int, default=128, metavar="N", help="tokens per rank per step")
    p.add_argument("--top-k", type=int, default=8, metavar="K")
    p.add_argument("--hidden", type=int, default=7168, metavar="H")
    p.add_argument("--payload", default="fp8", choices=("bf16", "fp16", "fp8"))
    p.add_argument("--gpu", default="rtx-pro-6000", choices=sorted(GPUS), help="cost estimate")
    p.add_argument("--gemm-json", metavar="FILE", help="bench_moe_gemm.py --json: measured curve")
    p.add_argument("--previous", metavar="FILE", help="current placements (ours or SGLang's map)")
    p.add_argument("--out", metavar="FILE", help="write our placements JSON")
    p.add_argument("--sglang-out", metavar="FILE", help="write SGLang's --init-expert-location")
    p.set_defaults(func=run)
    return p


def parse_list(text: str | None, limit: int, what: str) -> list[int]:
    if text is None:
        return list(range(limit))
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(
            f"--{what}: got {text!r}; allowed: numbers and ranges, e.g. 0-3,7"
        ) from None
    bad = [i for i in out if not 0 <= i < limit]
    if bad or not out:
        raise ValueError(f"--{what}: got {text!r}; allowed: values in [0, {limit})")
    return out


def _fail(msg: str) -> int:
    print(f"pcie-a2a balance: error: {msg}", file=sys.stderr)
    return 2


def _summary(m: Metrics) -> tuple[float, ...]:
    return (
        m.max_mean,
        m.socket_bytes / 1e6,
        m.uplink_bytes / 1e6,
        m.dispatch_us,
        m.gemm_us,
        m.combine_us,
        m.step_us,
    )


def _row(name: str, v: tuple[float, ...]) -> str:
    return f"{name:>8s} {v[0]:8.3f} {v[1]:10.2f} {v[2]:10.2f} " + " ".join(
        f"{x:9.1f}" for x in v[3:]
    )


HEADER = (
    f"{'':>8s} {'max/mean':>8s} {'socket MB':>10s} {'uplink MB':>10s} {'dispatch':>9s} "
    f"{'experts':>9s} {'combine':>9s} {'step µs':>9s}"
)


def run(args: argparse.Namespace) -> int:
    try:
        topo = load(args.topo) if args.topo else current()
        loads, share = io.read_loads(args.load)
        world = args.world or topo.num_gpus
        ranks = parse_list(args.ranks, topo.num_gpus, "ranks") if args.ranks else None
        if ranks is not None and len(ranks) != world:
            raise ValueError(f"--ranks: got {len(ranks)} GPUs; allowed: one per rank ({world})")
        if ranks is None and world != topo.num_gpus:
            raise ValueError(f"--world {world} with {topo.num_gpus} GPUs: pass --ranks")
        islands = Islands.from_topology(topo, ranks, TransferOptions.from_env())
        layers = parse_list(args.layers, loads.shape[0], "layers")
        cost = (
            GemmCost.from_bench_json(args.gemm_json)
            if args.gemm_json
            else GemmCost.roofline(args.gpu)
        )
        row_bytes = RowBytes.for_model(args.hidden, args.top_k, args.payload)
        opt = Options(args.redundant, args.tokens, args.top_k, cost, row_bytes)
        e_n = loads.shape[1]
        before = _previous(args.previous, world, e_n, loads.shape[0])
        prev = None if before is None else [before[i] for i in layers]
        if prev is not None and any(p.shape[1] * world != e_n + args.redundant for p in prev):
            prev = None  # another slot count: no penalty for moving, compare only
        results = balance(
            loads[layers], islands, opt, prev, None if share is None else share[layers]
        )
    except (TopologyError, ValueError, OSError) as exc:
        return _fail(str(exc))
    print(islands.describe())
    print(
        f"{len(layers)} layers, {e_n} experts, {world} ranks, {args.redundant} redundant; "
        f"step: {args.tokens} tokens per rank, top-{args.top_k}; GEMM cost: {cost.name}"
    )
    print(HEADER)
    totals = {"before": [], "after": []}
    moved = 0
    for layer, res in zip(layers, results):
        work = Workload(
            loads[layer], None if share is None else share[layer], args.tokens, args.top_k
        )
        if before is not None:
            old = to_placement(before[layer], e_n, islands.nearness())
        elif e_n % world == 0:
            old = to_placement(contiguous(e_n, world), e_n, None)
        else:
            old = None
        rows = [("after", expected(res.placement, work, islands, cost, row_bytes))]
        if old is not None:
            rows.insert(0, ("before", expected(old, work, islands, cost, row_bytes)))
        print(f"layer {layer}: {res.moved} experts moved" if prev else f"layer {layer}:")
        for name, m in rows:
            print(_row(name, _summary(m)))
            totals[name].append(_summary(m))
        moved += res.moved
    print("overall (mean over layers):")
    for name, vs in totals.items():
        if vs:
            print(_row(name, tuple(np.mean(vs, axis=0))))
    if prev:
        print(f"experts moved: {moved} ({moved * opt.expert_bytes / 1e9:.2f} GB of weights)")
    if args.out:
        io.write_placements(args.out, [r.placement for r in results], layers)
        print(f"wrote {args.out}")
    if args.sglang_out:
        maps = _full_maps(results, layers, loads.shape[0], e_n, world, args.redundant, before)
        io.write_sglang(args.sglang_out, maps)
        print(f"wrote {args.sglang_out} (SGLang --init-expert-location)")
    return 0


def _previous(path: str | None, world: int, e_n: int, n_layers: int):
    if path is None:
        return None
    try:
        doc = io.read_placements(path)
        slots = {i: from_placement(p) for i, p in doc.items()}
    except (ValueError, KeyError):
        slots = dict(enumerate(io.read_sglang(path, world)))
    missing = [i for i in range(n_layers) if i not in slots]
    if missing:
        raise ValueError(f"--previous {path}: no placement for layers {missing[:8]}")
    for s in slots.values():
        check_slots(s, e_n)
    return slots


def _full_maps(results, layers, n_layers, e_n, world, redundant, before):
    """A map for every layer (SGLang wants all): balanced ones, else the previous, else
    SGLang's trivial layout (physical p holds logical p % E)."""
    n = (e_n + redundant) // world
    trivial = (np.arange(world * n) % e_n).reshape(world, n)
    done = dict(zip(layers, (r.slots for r in results)))
    out = []
    for i in range(n_layers):
        if i in done:
            out.append(done[i])
        elif before is not None and before[i].shape == (world, n):
            out.append(before[i])
        else:
            out.append(trivial)
    return out
