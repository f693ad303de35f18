"""The ``pcie-a2a`` command: ``bench`` (dispatch benchmark), ``topo`` (topology plan),
``probe`` (measure this machine's GPU pairs and decide per pair), ``plan`` (which
parallel configuration and flags for a model on a box) and ``balance`` (expert
placements)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pcie-a2a", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from pcie_a2a.balance import cli as balance_cli
    from pcie_a2a.bench import cli as bench_cli
    from pcie_a2a.configplan import cli as plan_cli
    from pcie_a2a.topology import cli as topo_cli
    from pcie_a2a.topology import probe_cli

    bench_cli.add_parser(sub)
    topo_cli.add_parser(sub)
    probe_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    balance_cli.add_parser(sub)

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
