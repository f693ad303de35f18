"""One-GPU kernel times of the CUDA all-reduce (csrc/cuda/allreduce): W ranks in ONE process
on GPU 0, each a ``CudaAllReduce`` on its own stream, opened on each other's device segments
by pointer; one step (every rank's one-shot or two-shot kernel) is captured in a CUDA graph
(fork/join over the W streams) and replayed, so the time per call is device time without the
host's launch gaps, and the replays exercise the graph claim: frozen kernel arguments, the
call number and parity advanced on the device. Every replay's result is checked bit for bit
against the fp32 rank-order reference (the inputs are static, so each replay must give it).

NOT PCIe NUMBERS: "peer" memory is this GPU's own HBM, and W ranks share its SMs. What it
measures is the kernels' own cost (flag round trips through L2, the sums, block counts);
the ``copy`` row is the device's own copy of the same bytes, for scale.

Needs a CUDA build and a GPU; without one it exits 2 and says why. The reduced run for
scripts/gpu_check.sh (< 1 minute)::

    PYTHONPATH=python python benchmarks/bench_allreduce_one_gpu.py --quick --json build/bench_allreduce_one_gpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("pcie_a2a") is None:  # not installed: the source tree's build
    sys.path.insert(0, str(ROOT / "python"))

KB = 1024
SIZES = [1 * KB, 4 * KB, 14 * KB, 16 * KB, 64 * KB, 256 * KB, 1024 * KB]
QUICK_SIZES = [1 * KB, 14 * KB, 64 * KB]
WORLDS = [2, 4, 8]
NOTE = "ONE GPU: the ranks share GPU 0's SMs and memory; these are NOT PCIe numbers."


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of ints") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive ints")
    return vals


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", type=_ints, help="bytes per rank (default 1 KB .. 1 MB)")
    p.add_argument("--worlds", type=_ints, help="ranks on the one GPU (default 2,4,8)")
    p.add_argument("--replays", type=int, default=50, help="graph replays per sample (50)")
    p.add_argument("--samples", type=int, default=7, help="timed samples, median reported (7)")
    p.add_argument(
        "--quick", action="store_true", help="sizes 1,14,64 KB, worlds 2,8, 20 replays x 5"
    )
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes = a.sizes or QUICK_SIZES
        a.worlds = a.worlds or [2, 8]
        a.replays, a.samples = min(a.replays, 20), min(a.samples, 5)
    a.sizes = a.sizes or SIZES
    a.worlds = a.worlds or WORLDS
    if any(s % 16 for s in a.sizes):
        p.error(f"--sizes: got {a.sizes}; allowed: multiples of 16 bytes")
    if max(a.worlds) > 16 or a.replays < 1 or a.samples < 1:
        p.error("--worlds: at most 16 ranks; --replays and --samples: positive")
    return a


def fits(world: int, blocks: int, sms: int, per_sm: int = 2) -> bool:
    """Every rank's blocks must be resident at once (a block waits for the same block of the
    other ranks); with one GPU for all ranks that bounds the grid: W x blocks <= SMs x 2
    (256 threads, ~120 registers per thread: two blocks per SM)."""
    return world * blocks <= sms * per_sm


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    from pcie_a2a import cuda_available, cuda_unavailable_reason
    from pcie_a2a.allreduce import reference as R

    if not cuda_available():
        print(f"bench_allreduce_one_gpu: needs a GPU: {cuda_unavailable_reason()}", file=sys.stderr)
        return 2
    try:
        from pcie_a2a import _allreduce_cuda as mod
    except ImportError as exc:
        print(
            f"bench_allreduce_one_gpu: needs a GPU build with the all-reduce: {exc}",
            file=sys.stderr,
        )
        return 2
    from pcie_a2a.allreduce.cpu import native as cpu_native

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    rows, failures = [], []
    print(NOTE)
    print(
        f"device: {props.name}, {sms} SMs; {args.replays} graph replays per sample, median of {args.samples}"
    )
    print(f"{'world':>5} {'algo':>9} {'bytes':>9} {'us/call':>9} {'copy us':>8}  check")
    for world in args.worlds:
        for nbytes in args.sizes:
            numel = nbytes // 2
            xs = [
                torch.randn(numel, generator=torch.Generator().manual_seed(r)).bfloat16()
                for r in range(world)
            ]
            want = R.sum_in_rank_order(xs)
            for algo, code in (("one_shot", 1), ("two_shot", 2)):
                blocks, _ = cpu_native().chunks(code, numel // 8, world)
                if not fits(world, blocks, sms):
                    print(
                        f"{world:>5} {algo:>9} {nbytes:>9} {'skipped':>9}  ({world} x {blocks} blocks > 2 per SM)"
                    )
                    continue
                row = _measure(torch, mod, world, nbytes, code, xs, want, args)
                row |= {"world": world, "algo": algo, "bytes": nbytes, "blocks": blocks}
                rows.append(row)
                if not row["exact"]:
                    failures.append(
                        f"world {world} {algo} {nbytes} B: result differs from the reference"
                    )
                print(f"{world:>5} {algo:>9} {nbytes:>9} {row['us_per_call']:>9.2f} {row['copy_us']:>8.2f}  "
                      f"{'exact' if row['exact'] else 'WRONG'}")  # fmt: skip
    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "note": NOTE,
        "device": props.name,
        "sms": sms,
        "replays": args.replays,
        "samples": args.samples,
        "results": rows,
        "failures": failures,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"JSON: {args.json}")
    for f in failures:
        print(f"CHECK FAILED: {f}")
    return 1 if failures else 0


def _measure(torch, mod, world, nbytes, algo, xs, want, args) -> dict:
    dev = torch.device("cuda", 0)
    comms = [mod.CudaAllReduce(r, world, nbytes, 2, 0, False) for r in range(world)]
    try:
        local = [c.segment_ptr for c in comms]
        for c in comms:
            c.open_peers([b""] * world, local, [0] * world * world)
        x = [t.to(dev) for t in xs]
        out = [torch.empty_like(t) for t in x]
        streams = [torch.cuda.Stream(dev) for _ in range(world)]
        main_stream = torch.cuda.current_stream(dev)

        def step():
            fork = torch.cuda.Event()
            fork.record(main_stream)
            done = []
            for r, (c, s) in enumerate(zip(comms, streams)):
                s.wait_event(fork)
                c.run(
                    algo,
                    0,
                    x[r].data_ptr(),
                    x[r].numel(),
                    0,
                    out[r].data_ptr(),
                    10.0,
                    s.cuda_stream,
                )
                e = torch.cuda.Event()
                e.record(s)
                done.append(e)
            for e in done:
                main_stream.wait_event(e)

        step()  # eager once: the kernels are loaded before capture
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        times = []
        for _ in range(args.samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize(dev)
            times.append(start.elapsed_time(end) * 1e3 / args.replays)
        for c in comms:
            c.check()  # a kernel that timed out or disagreed raises here
        exact = all(torch.equal(o.cpu().view(torch.int16), want.view(torch.int16)) for o in out)
        copy_src = torch.empty((world - 1) * nbytes, dtype=torch.uint8, device=dev)
        copy_dst = torch.empty_like(copy_src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            copy_dst.copy_(copy_src)
        end.record()
        torch.cuda.synchronize(dev)
        copy_us = start.elapsed_time(end) * 1e3 / args.replays
        return {
            "us_per_call": statistics.median(times),
            "samples_us": times,
            "copy_us": copy_us,
            "exact": exact,
        }
    finally:
        torch.cuda.synchronize(dev)
        for c in comms:
            c.close()


if __name__ == "__main__":
    sys.exit(main())
