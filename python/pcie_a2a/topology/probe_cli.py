"""``pcie-a2a probe``: measure this machine's GPU pairs (known-answer gate first), derive
per-pair numbers, decide push/pull, P2P/staged and SM/copy engine per pair, print the
diagnosis and the predicted Kimi K2 decode time, and cache the record for ``Buffer``.

Without GPUs it exits with status 2 and says so; ``--probe-file`` reads a recorded probe
instead (its decisions are made again for this topology, its samples derived again)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .. import env
from .calibration import derive
from .errors import TopologyError
from .model import Topology
from .planner import TransferOptions, plan_transfers
from .predict import format_predictions, predict
from .probe import Probe, ProbeGateError, ProbeUnavailable
from .render import format_plan
from .sources import load_probe

_COLUMNS = (
    ("store", "store_gbps"),
    ("load", "load_gbps"),
    ("CE", "ce_gbps"),
    ("CE rd", "ce_read_gbps"),
    ("staged", "staged_gbps"),
    ("a2a st", "a2a_store_gbps"),
    ("a2a ld", "a2a_load_gbps"),
    ("st us", "store_us"),
    ("ld us", "load_us"),
    ("CE us", "ce_us"),
    ("stg us", "staged_us"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "probe", help="measure GPU pairs and decide per pair", description=__doc__
    )
    p.add_argument(
        "--probe-file", metavar="FILE", help="a recorded probe (JSON) instead of measuring"
    )
    p.add_argument(
        "--from",
        dest="source",
        metavar="FILE",
        help="the topology to plan with (default: the record's, else this machine)",
    )
    p.add_argument("--out", metavar="FILE", help="also write the probe record (JSON) to FILE")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.add_argument("--no-cache", action="store_true", help="do not write this machine's cache")
    p.add_argument(
        "--budget-s", type=float, default=60.0, metavar="S", help="time budget (default 60)"
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=128,
        metavar="N",
        help="decode tokens per rank for the prediction",
    )
    p.add_argument(
        "--link-gen",
        type=int,
        default=4,
        metavar="N",
        help="PCIe generation where the topology does not say (default 4)",
    )
    p.set_defaults(func=run)
    return p  # fmt: skip


def _fail(msg: str, code: int = 2) -> int:
    print(f"pcie-a2a probe: error: {msg}", file=sys.stderr)
    return code


def format_probe(probe: Probe, topo: Topology) -> str:
    """The record as text: the per-pair table, the patterns and the diagnosis."""
    out = [f"probe: {probe.source}"]
    if probe.fingerprint:
        out.append(f"  machine fingerprint {probe.fingerprint}, driver {probe.driver or '?'}")
    if probe.elapsed_s is not None:
        out.append(f"  measured in {probe.elapsed_s:.1f} s")
    out.append("")
    out.append("pairs: GB/s per direction with both directions busy; latency in us, one way")
    out.append("  pair   class " + "".join(f"{h:>7}" for h, _ in _COLUMNS))
    for (a, b), m in sorted(probe.pairs.items()):
        cls = topo.classes[a][b] if a < topo.num_gpus and b < topo.num_gpus else "?"
        vals = "".join(
            f"{getattr(m, f):7.2f}" if getattr(m, f) is not None else f"{'-':>7}"
            for _, f in _COLUMNS
        )
        out.append(f"  {f'{a}->{b}':<6} {cls:<5}{vals}")
    if probe.patterns:
        out.append("")
        out.append("concurrent patterns (every flow started together)")
        for p in probe.patterns:
            lo, hi = min(p.flow_gbps), max(p.flow_gbps)
            out.append(
                f"  {p.name:<44} {len(p.flows):3d} flows {p.aggregate_gbps:7.1f} GB/s "
                f"(per flow {lo:.1f}-{hi:.1f})"
            )
    skipped = (probe.settings or {}).get("skipped") or []
    if skipped:
        out.append("  skipped: " + "; ".join(skipped))
    out.append("")
    out.append("diagnosis")
    out.extend(f"  - {line}" for line in probe.diagnosis or ["nothing to report"])
    return "\n".join(out)


def _topology(args: argparse.Namespace, probe: Probe | None) -> Topology:
    from .live import discover
    from .sources import load

    if args.source:
        return load(args.source)
    if probe is not None and probe.topology is not None:
        return Topology.from_dict(probe.topology, f"{probe.source} (recorded topology)")
    return discover()


def run(args: argparse.Namespace) -> int:
    from .diagnosis import diagnose

    try:
        if args.probe_file:
            probe = load_probe(args.probe_file)
            if probe.samples is not None:
                pairs, patterns = derive(probe.samples)
                probe = dataclasses.replace(probe, pairs=pairs, patterns=patterns)
            topo = _topology(args, probe)
            aligned = probe.aligned_to([g.bus_id for g in topo.gpus])
            from .probe_run import finish

            facts = None
            probe = finish(probe, topo, diagnose(topo, aligned, facts) or list(probe.diagnosis))
        else:
            from .probe_run import ProbeSettings, measure

            topo = _topology(args, None)
            try:
                probe = measure(topo, ProbeSettings(budget_s=args.budget_s))
            except ProbeUnavailable as exc:
                return _fail(f"{exc}; nothing was measured (--probe-file reads a recorded probe)")
            except ProbeGateError as exc:
                return _fail(str(exc), 1)
            probe = dataclasses.replace(probe, topology=topo.to_dict())
            if not args.no_cache and env.probe_cache():
                from .probe_cache import save

                path = save(probe)
                print(f"cached as {path} (Buffer picks it up on this machine)", file=sys.stderr)
    except (TopologyError, ValueError, OSError) as exc:
        return _fail(str(exc))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(probe.to_json())
    if args.json:
        print(probe.to_json(), end="")
        return 0
    options = TransferOptions.from_env(probe=probe, default_link_gen=args.link_gen)
    result = plan_transfers(topo, options=options)
    print(format_probe(probe.aligned_to([g.bus_id for g in topo.gpus]), topo))
    print()
    print(format_plan(result))
    n = topo.num_gpus
    if n >= 2 and 384 % n == 0:
        print()
        print(format_predictions([predict(topo, options, args.tokens, base=result)]))
    return 0
