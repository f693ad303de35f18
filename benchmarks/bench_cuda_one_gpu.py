"""One-GPU report of the CUDA transport: per-call device time of low-latency dispatch and
combine for 1, 2, 4 and 8 IPC ranks sharing GPU 0, and the bytes per second the pack/unpack
kernels achieve against the device's own copy bandwidth (measured in the same run).

NOT PCIe NUMBERS. All ranks run on one GPU: their kernels time-slice the SMs (separate
processes, no MPS) and "P2P" is CUDA IPC within one device's memory. Times include the
waits for the other ranks and the host's launch gaps between the events.

Workload: a Kimi K2 decode step (hidden 7168, 384 experts, top-8, 128 tokens per rank,
uniform routing, bf16 activations), fp8 and bf16 payloads, rows layout, through the
graph-capturable ``CudaTransport`` methods:
  dispatch = dispatch_send_async + recv_rows_async (device-side flag wait)
  combine  = combine_send_async + combine_recv_async
and a prefill step (PREFILL_TOKENS per rank, bf16) in normal mode through
``Buffer.dispatch``/``Buffer.combine`` (backend="cuda"), once with warp
stores only ("normal-warp") and once with every pair on the copy engine
("normal-copy_engine": cudaMemcpyAsync + flag kernel), to compare the two send paths.
Each timed call starts after a gloo all_reduce (every rank starts together) and is
bracketed by CUDA events on the rank's stream. A call's time is the slowest rank's;
median and p99 are over iterations. Bytes come from ``CudaTransport.last_bytes()``,
summed over ranks (the local copy included: the one GPU moves those too).

Needs a CUDA build and a GPU; without one it exits 2 and says why. Budget: < 3 minutes::

    PYTHONPATH=python python benchmarks/bench_cuda_one_gpu.py --json build/bench_cuda_one_gpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # dist_utils
if importlib.util.find_spec("pcie_a2a") is None:  # not installed: the source tree's build
    sys.path.insert(0, str(ROOT / "python"))

HIDDEN, EXPERTS, TOPK, TOKENS = 7168, 384, 8, 128
PREFILL_TOKENS = 2048
NORMAL_SETTINGS = {"normal-warp": None, "normal-copy_engine": 0}  # copy_engine_min_bytes
PAYLOADS = {"fp8": 2, "bf16": 0}
NOTE = (
    "ONE GPU: all ranks share GPU 0 and time-slice its SMs; IPC stays in one device's "
    "memory. These are NOT PCIe numbers."
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _worlds(text: str) -> list[int]:
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    bad = [w for w in worlds if w not in (1, 2, 4, 8)]
    if bad or len(set(worlds)) != len(worlds):
        raise argparse.ArgumentTypeError(f"{text!r}: each of 1, 2, 4, 8 at most once")
    return worlds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=_worlds, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    p.add_argument("--warmup", type=_positive_int, default=5, help="untimed calls per op")
    p.add_argument("--iters", type=_positive_int, default=200, help="most timed calls per op")
    p.add_argument(
        "--budget-s",
        type=_positive_float,
        default=6.0,
        help="stop timing a payload after this many seconds (fewer than --iters calls)",
    )
    p.add_argument(
        "--world-timeout-s",
        type=_positive_float,
        default=45.0,
        help="a world not done by then is killed and reported",
    )
    p.add_argument("--copy-mib", type=_positive_int, default=512, help="copy-bandwidth size")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def unavailable_reason() -> str:
    """Why this cannot run here ("" when it can)."""
    from pcie_a2a import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        return reason
    try:
        from pcie_a2a import _cuda_transport  # noqa: F401
    except ImportError as exc:
        return f"pcie_a2a._cuda_transport is not in this build: {exc}"
    return ""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100])."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def machine() -> dict:
    import torch

    driver = "unknown"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        driver = out.stdout.strip() or driver
    except (OSError, subprocess.SubprocessError):
        pass
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": driver,
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
    }


def copy_bandwidth(mib: int, iters: int = 20) -> dict:
    """Device-to-device copy of `mib` MiB: bytes copied / median time (each byte is read
    once and written once, as the pack/unpack bytes below count each row once)."""
    import torch

    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device="cuda:0").fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    med = percentile(times, 50)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": n, "iters": iters, "median_s": med, "gbps": n / med / 1e9}


# ---- one rank (runs in a spawned process, as the multi-process tests run theirs) -------
def _rank_inputs(rank: int):
    import torch

    g = torch.Generator(device="cuda:0").manual_seed(1000 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g, device="cuda:0").to(torch.bfloat16)
    scores = torch.rand(TOKENS, EXPERTS, generator=g, device="cuda:0")
    ids = scores.topk(TOPK, dim=1).indices.to(torch.int32)  # 8 distinct experts per token
    w = torch.softmax(torch.rand(TOKENS, TOPK, generator=g, device="cuda:0"), dim=1)
    return x, ids, w


def _rank_main(rank: int, world: int, warmup: int, iters: int, budget_s: float) -> dict:
    import torch
    import torch.distributed as dist

    from pcie_a2a.placement import Placement
    from pcie_a2a.transport.cuda import CudaTransport

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    x, ids, w = _rank_inputs(rank)
    m = TOKENS
    out: dict = {}
    for name, code in PAYLOADS.items():
        tx = CudaTransport(
            None, rank, world, HIDDEN, m, TOPK, code, 0, Placement.contiguous(EXPERTS, world),
            device=0, timeout_s=10.0,
        )  # fmt: skip
        try:
            b = {
                "send_token": torch.empty(world * m, dtype=torch.int32, device=dev),
                "send_count": torch.empty(world, dtype=torch.int32, device=dev),
                "counts": torch.empty(world, dtype=torch.int32, device=dev),
                "xo": torch.empty(world * m, HIDDEN, dtype=torch.bfloat16, device=dev),
                "src_rank": torch.empty(world * m, dtype=torch.int32, device=dev),
                "src_token": torch.empty(world * m, dtype=torch.int32, device=dev),
                "ids_o": torch.empty(world * m, TOPK, dtype=torch.int32, device=dev),
                "ws_o": torch.empty(world * m, TOPK, dtype=torch.float32, device=dev),
                "per_expert": torch.empty(tx.num_local_experts, dtype=torch.int32, device=dev),
                "out": torch.empty(m, HIDDEN, dtype=torch.bfloat16, device=dev),
            }

            def dispatch(ticket, b=b, tx=tx):
                tx.dispatch_send_async(ticket, 3, x, ids, w, b["send_token"], b["send_count"])
                tx.recv_rows_async(ticket, b["counts"], b["xo"], None, None, b["src_rank"],
                                   b["src_token"], b["ids_o"], b["ws_o"], b["per_expert"])  # fmt: skip

            def combine(ticket, b=b, tx=tx):
                # y = the received rows themselves (the expert's work is not measured)
                tx.combine_send_async(ticket, 4, b["xo"], b["counts"])
                tx.combine_recv_async(ticket, b["send_token"], b["send_count"], m, b["out"])

            steps = [
                ("dispatch", lambda tx=tx: dispatch(tx.new_ticket())),
                ("combine", lambda tx=tx: combine(tx.new_ticket())),
            ]
            times, nbytes = _timed_loop(tx, steps, warmup, iters, budget_s)
            out[name] = {"times_s": times, "bytes_per_dest": nbytes}
            torch.cuda.synchronize()
            dist.barrier()  # every rank done before anyone frees its segment
        finally:
            tx.close()
    out.update(_rank_normal(rank, world, warmup, iters, budget_s / 2))
    return out


def _timed_loop(tx, steps, warmup: int, iters: int, budget_s: float):
    """Runs each (op, fn) of `steps` per iteration after a collective start; returns the
    per-op event times and the bytes of each op's last call."""
    import torch
    import torch.distributed as dist

    times: dict[str, list[float]] = {op: [] for op, _ in steps}
    nbytes: dict[str, list[int]] = {}
    deadline = None
    for it in range(warmup + iters):
        if it == warmup:
            deadline = time.monotonic() + budget_s
        stop = torch.tensor([int(deadline is not None and time.monotonic() > deadline)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        for op, fn in steps:
            dist.barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            tx.check()
            if it >= warmup:
                times[op].append(start.elapsed_time(end) / 1e3)
            nbytes[op] = tx.last_bytes()
    return times, nbytes


def _rank_normal(rank: int, world: int, warmup: int, iters: int, budget_s: float) -> dict:
    """Normal-mode prefill step through the Buffer (what users call), warp stores vs copy
    engine (NORMAL_SETTINGS: the transport's threshold is switched between timings)."""
    import torch
    import torch.distributed as dist

    import pcie_a2a

    dev = torch.device("cuda", 0)
    m = PREFILL_TOKENS
    g = torch.Generator(device="cuda:0").manual_seed(2000 + rank)
    x = torch.randn(m, HIDDEN, generator=g, device=dev).to(torch.bfloat16)
    ids = torch.rand(m, EXPERTS, generator=g, device=dev).topk(TOPK, dim=1).indices.int()
    w = torch.softmax(torch.rand(m, TOPK, generator=g, device=dev), dim=1)
    buf = pcie_a2a.Buffer(None, EXPERTS, HIDDEN, m, num_topk=TOPK, backend="cuda", timeout_s=10.0)
    out: dict = {}
    try:
        tx = buf._transport  # the CudaTransport: its threshold picks the send path
        last: dict = {}

        def dispatch() -> None:
            last["r"] = buf.dispatch(x, ids, w)

        def combine() -> None:
            buf.combine(last["r"].x, last["r"].handle)  # y = the received rows

        for name, min_bytes in NORMAL_SETTINGS.items():
            tx.copy_engine_min_bytes = min_bytes
            times, nbytes = _timed_loop(
                tx, [("dispatch", dispatch), ("combine", combine)], warmup, iters, budget_s
            )
            out[name] = {"times_s": times, "bytes_per_dest": nbytes}
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        buf.close()
    return out


# ---- the parent: spawn each world, combine the ranks' samples ----------------------------
def summarise(world: int, payload: str, op: str, ranks: list[dict], copy_gbps: float) -> dict:
    per_rank = [r[payload]["times_s"][op] for r in ranks]
    n = min(len(t) for t in per_rank)
    call = [max(t[i] for t in per_rank) for i in range(n)]  # the slowest rank's time
    all_bytes = sum(sum(r[payload]["bytes_per_dest"][op]) for r in ranks)
    wire = 0  # bytes into another rank's segment (what would cross a link)
    for rank, r in enumerate(ranks):
        wire += sum(b for d, b in enumerate(r[payload]["bytes_per_dest"][op]) if d != rank)
    row = {"world": world, "payload": payload, "op": op, "ok": True, "iters": n}
    if n == 0:
        return {**row, "ok": False, "error": "no timed iterations (budget too small?)"}
    med = percentile(call, 50)
    gbps = all_bytes / med / 1e9
    return {
        **row,
        "median_us": med * 1e6,
        "p99_us": percentile(call, 99) * 1e6,
        "rank_median_us": [percentile(t, 50) * 1e6 for t in per_rank],
        "bytes_all_ranks": all_bytes,
        "wire_bytes": wire,
        "gbps": gbps,
        "ratio_to_copy": gbps / copy_gbps,
    }


def run_world(world: int, args: argparse.Namespace, copy_gbps: float) -> list[dict]:
    from dist_utils import run_ranks

    outcomes = run_ranks(
        world, _rank_main, args.warmup, args.iters, args.budget_s, timeout=args.world_timeout_s
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        why = "; ".join(f"rank {o.rank} {o.error_type}: {o.error}" for o in failed)
        for o in failed:
            if o.traceback:
                print(f"world {world} rank {o.rank}:\n{o.traceback}", file=sys.stderr)
        return [{"world": world, "ok": False, "error": why}]
    ranks = [o.value for o in outcomes]
    rows = []
    for payload in [*PAYLOADS, *NORMAL_SETTINGS]:
        for op in ("dispatch", "combine"):
            rows.append(summarise(world, payload, op, ranks, copy_gbps))
    return rows


def table(rows: list[dict], copy: dict) -> str:
    head = (
        f"{'world':>5} {'payload':>18} {'op':>8} {'iters':>5} {'median us':>10} {'p99 us':>9}"
        f" {'MB/call':>8} {'GB/s':>7} {'x copy':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r["ok"]:
            what = f"{r.get('payload', '')} {r.get('op', '')}".strip() or "all"
            lines.append(f"{r['world']:>5} FAILED ({what}): {r['error']}")
            continue
        lines.append(
            f"{r['world']:>5} {r['payload']:>18} {r['op']:>8} {r['iters']:>5}"
            f" {r['median_us']:>10.1f} {r['p99_us']:>9.1f} {r['bytes_all_ranks'] / 1e6:>8.2f}"
            f" {r['gbps']:>7.1f} {r['ratio_to_copy']:>7.3f}"
        )
    lines.append(
        f"device copy bandwidth: {copy['gbps']:.1f} GB/s ({copy['bytes'] >> 20} MiB D2D, median"
        f" of {copy['iters']}); GB/s = all ranks' bytes per call / median call time"
    )
    lines.append(NOTE)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"bench_cuda_one_gpu: needs a GPU and a CUDA build: {reason}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    info = machine()
    print(f"machine: {info}")
    print(NOTE)
    copy = copy_bandwidth(args.copy_mib)
    print(f"device copy bandwidth: {copy['gbps']:.1f} GB/s", flush=True)
    rows: list[dict] = []
    for world in args.worlds:
        t = time.monotonic()
        try:
            got = run_world(world, args, copy["gbps"])
        except Exception as exc:  # report it and go on with the next world
            got = [{"world": world, "ok": False, "error": f"{type(exc).__name__}: {exc}"}]
        rows += got
        state = "ok" if all(r["ok"] for r in got) else "FAILED"
        print(f"world {world}: {state} in {time.monotonic() - t:.1f}s", flush=True)
    result = {
        "note": NOTE,
        "machine": info,
        "workload": {
            "hidden": HIDDEN,
            "experts": EXPERTS,
            "topk": TOPK,
            "tokens_per_rank": TOKENS,
            "dtype": "bf16",
            "layout": "rows (low latency)",
            "prefill_tokens_per_rank": PREFILL_TOKENS,
            "prefill": "normal mode, bf16: warp stores vs copy engine",
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "copy_bandwidth": copy,
        "results": rows,
        "elapsed_s": time.monotonic() - t0,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    print()
    print(table(rows, copy))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
