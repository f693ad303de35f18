"""``pcie-a2a topo``: the topology, the per-pair plan (path, direction, engine, each with its
reason), the staging placement, the send schedule and the predicted Kimi K2 decode
all-to-all time."""

from __future__ import annotations

import argparse
import json
import sys

from .. import env
from .errors import TopologyError
from .live import discover
from .planner import TransferOptions, expected_distinct_ranks, kimi_k2_decode, plan_transfers
from .predict import PAYLOADS, format_predictions, predict
from .probe import ProbeGateError, ProbeUnavailable
from .render import format_plan, format_tree
from .roots import with_vendor_hints
from .sources import current_with_probe, load_probe, load_with_probe


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "topo",
        help="show the GPU topology and the transfer plan",
        description=__doc__,
    )
    p.add_argument(
        "--from",
        dest="source",
        metavar="FILE",
        help="nvidia-smi topo -m text, NCCL topology XML, pcie_a2a JSON, p2pBandwidthLatencyTest "
        "output, NCCL_DEBUG=INFO path lines or nccl-tests output, told apart by content "
        "(default: PCIE_A2A_TOPO_FILE, else this machine)",
    )
    p.add_argument("--json", action="store_true", help="print the topology and the plan as JSON")
    p.add_argument(
        "--probe", action="store_true", help="measure every GPU pair on this machine (needs GPUs)"
    )
    p.add_argument(
        "--probe-file",
        metavar="FILE",
        help="measured numbers: pcie-a2a probe JSON or p2pBandwidthLatencyTest output "
        "(default: PCIE_A2A_PROBE_FILE, else the file's own, else this machine's cached probe)",
    )
    p.add_argument(
        "--link-gen",
        type=int,
        default=4,
        metavar="N",
        help="PCIe generation to assume where the source does not say (default 4)",
    )
    p.add_argument(
        "--cpu-vendor",
        choices=("amd", "intel"),
        help="the CPU (root complex) vendor where the source does not say (topo -m does not)",
    )
    p.add_argument(
        "--switch-vendor",
        choices=("broadcom", "plx", "microchip"),
        help="the PCIe switch vendor where the source does not say",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=128,
        metavar="N",
        help="decode tokens per rank for the Kimi K2 prediction (default 128)",
    )
    p.add_argument(
        "--payload",
        choices=PAYLOADS,
        default="fp8",
        help="dispatch payload of the Kimi K2 step in the plan (default fp8)",
    )
    p.add_argument(
        "--predict",
        action="store_true",
        help="print only the predicted Kimi K2 decode dispatch+combine time (fp8 and bf16)",
    )
    p.add_argument("--save", metavar="FILE", help="also write the plan as JSON to FILE")
    p.add_argument("--sysfs", default="/sys", help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


def _fail(msg: str) -> int:
    print(f"pcie-a2a topo: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        if args.source:
            topo, measured = load_with_probe(args.source)
        elif args.sysfs == "/sys":
            topo, measured = current_with_probe(args.sysfs)
        else:
            topo, measured = discover(args.sysfs), None
        probe = None
        if args.probe:
            from .probe_run import measure

            try:
                probe = measure(topo)
            except (ProbeUnavailable, ProbeGateError) as exc:
                return _fail(f"{exc}; no numbers were measured (use --probe-file for saved ones)")
        elif args.probe_file:
            probe = load_probe(args.probe_file)
        elif args.source and env.probe_file():
            probe = load_probe(env.probe_file())  # type: ignore[arg-type]
        # A p2pBandwidthLatencyTest file carries its own measurements; numbers asked for on
        # the command line (--probe, --probe-file) take precedence.
        probe = probe or measured
        topo = with_vendor_hints(topo, args.cpu_vendor, args.switch_vendor)
        options = TransferOptions.from_env(probe=probe, default_link_gen=args.link_gen)
        n = topo.num_gpus
        kimi = n >= 2 and 384 % n == 0
        traffic = kimi_k2_decode(n, args.tokens, args.payload) if kimi else ()
        result = plan_transfers(topo, traffic, options)
        if args.predict:
            if not kimi:
                return _fail(
                    f"no Kimi K2 prediction for {n} GPUs: its 384 experts must split evenly"
                )
            print(format_predictions([predict(topo, options, args.tokens, base=result)]))
            return 0
    except (TopologyError, ValueError, OSError) as exc:
        return _fail(str(exc))
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            f.write(result.to_json())
    if args.json:
        doc = {"topology": topo.to_dict(), "plan": json.loads(result.to_json())}
        print(json.dumps(doc, indent=1))
        return 0
    note = ""
    if traffic:
        k = expected_distinct_ranks(n, 384, 8)
        note = (
            f"Kimi K2 decode step: hidden 7168, 384 experts, top-8, {args.tokens} tokens per "
            f"rank, uniform routing: a token goes to E[distinct ranks] = {k:.2f} of {n} ranks"
        )
    print(format_tree(topo))
    print()
    print(format_plan(result, note))
    if not traffic and n >= 2:
        print(f"\nno Kimi K2 prediction: its 384 experts do not split evenly over {n} GPUs")
    return 0
