"""``pcie-a2a plan``: for a model on a box, every parallel configuration with its predicted
decode throughput, why the ones that cannot run cannot, the recommendation and the SGLang
and vLLM command lines. See docs/plan.md for the model behind the numbers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..gpus import GPUS
from .models import BUILTIN
from .stacks import STACKS


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="which parallel configuration and flags, for a model on this box",
        description=__doc__,
    )
    p.add_argument(
        "--model",
        default="kimi-k2.6",
        help=f"built-in name ({', '.join(BUILTIN)}) or a config.json / model directory "
        "(default kimi-k2.6)",
    )
    p.add_argument("--gpus", type=int, help="GPUs to plan for (default: the topology's)")
    p.add_argument("--gpu", help=f"GPU type: {', '.join(GPUS)} (default: from the topology)")
    p.add_argument(
        "--topo",
        "--from",
        dest="topo",
        metavar="FILE",
        help="any dump `pcie-a2a topo --from` reads, or a fixture name (default: this machine, "
        "else an assumed box)",
    )
    p.add_argument(
        "--probe",
        metavar="FILE",
        help="measured pair numbers (pcie_a2a probe JSON, p2pBandwidthLatencyTest output, or "
        "JSON with 'pairs' / 'exchanges'; docs/plan.md)",
    )
    p.add_argument("--bench", metavar="FILE", help="a `pcie-a2a bench --backend cuda` JSON")
    p.add_argument(
        "--context",
        type=int,
        default=4096,
        help="prompt tokens per request (default 4096)",
    )
    p.add_argument(
        "--output",
        type=int,
        default=1024,
        help="output tokens per request (default 1024): a decode step reads context + output/2 "
        "on average; --max-model-len / --context-length = context + output",
    )
    p.add_argument(
        "--max-tpot-ms",
        dest="max_tpot_ms",
        type=float,
        default=50.0,
        help="time-per-output-token cap of the throughput recommendation (default 50 ms)",
    )
    p.add_argument(
        "--config",
        metavar="FLAGS",
        help="explain one configuration named in SGLang's or vLLM's own flags, e.g. "
        '"--tp-size 4 --ep-size 2" or "--tensor-parallel-size 2 --data-parallel-size 4 '
        '--enable-expert-parallel"',
    )
    p.add_argument(
        "--stack", default="vllm-tuned", help=f"{', '.join(STACKS)} (default vllm-tuned)"
    )
    p.add_argument(
        "--stack-file",
        dest="stack_file",
        metavar="FILE",
        help="JSON of your own stack (parts and calibration numbers; docs/plan.md)",
    )
    p.add_argument("--kv-cache-dtype", dest="kv_dtype", default="bf16", help="bf16 or fp8")
    p.add_argument(
        "--routing",
        metavar="FILE",
        help="routing statistics: JSON per-expert token counts (or SGLang logical_count)",
    )
    p.add_argument(
        "--skew", type=float, default=0.0, help="Zipf exponent of expert popularity (0 uniform)"
    )
    p.add_argument("--seed", type=int, default=0, help="expert order of --skew (default 0)")
    p.add_argument(
        "--redundant-experts",
        dest="redundant",
        type=int,
        default=0,
        help="extra expert slots for EP configurations (placed by pcie_a2a.balance.eplb)",
    )
    p.add_argument("--payload", default="fp8", help="pcie_a2a dispatch payload: fp8 or bf16")
    p.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="also plan N nodes of this box joined by --nic (1: the box alone, the default)",
    )
    p.add_argument(
        "--nic",
        metavar="SPEC",
        help="the NICs per node: COUNTxRATEg-KIND[-gdr|-nogdr], KIND roce, ib or eth, "
        "no GPUDirect RDMA unless -gdr (e.g. 2x100g-roce, 1x400g-ib-gdr, 1x25g-eth)",
    )
    p.add_argument("--tables", metavar="FILE", help="JSON replacing measured/assumed tables")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of tok/s against concurrency")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pcie_a2a.topology import TopologyError

    from . import report
    from .api import Inputs, make_plan

    try:
        inp = Inputs(
            model=args.model,
            gpus=args.gpus,
            gpu=args.gpu,
            topo=args.topo,
            probe=args.probe,
            bench=args.bench,
            context=args.context,
            output=args.output,
            stack=args.stack,
            stack_file=args.stack_file,
            max_tpot_ms=args.max_tpot_ms,
            config=args.config,
            kv_dtype=args.kv_dtype,
            routing=args.routing,
            skew=args.skew,
            seed=args.seed,
            redundant=args.redundant,
            payload=args.payload,
            tables=args.tables,
            nodes=args.nodes,
            nic=args.nic,
        )
        result = make_plan(inp)
    except (ValueError, TopologyError, OSError) as exc:
        print(f"pcie-a2a plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(report.to_json(result))
    else:
        sys.stdout.write(report.text(result))
    if args.plot:
        why = report.plot(Path(args.plot), result)
        msg = f"plot: {args.plot}" if why is None else f"plot skipped: {why}"
        print(msg, file=sys.stderr if args.json else sys.stdout)
    return 0
