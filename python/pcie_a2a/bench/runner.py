"""Starts the ranks: spawned processes on a free loopback port, or, under torchrun
(RANK and WORLD_SIZE set), this process as one rank of the launcher's group.

The group's backend is ``cfg["pg_backend"]`` (gloo, or NCCL for ``--backend cuda`` with a
GPU per rank; bench/device.py). With ``--backend cuda`` a rank makes its GPU
(``local rank % device_count``) the current device before the group exists, so that NCCL,
the object collectives and ``Buffer(backend="cuda")`` all use it.

Spawned ranks are joined with deadlines and always torn down; a rank that fails makes
the others stop within a short grace period. Shared-memory segments are unlinked by the
Buffer right after bootstrap; names a killed rank may have left are removed here.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from pathlib import Path

from pcie_a2a import env

_GRACE_S = 10.0


class BenchError(RuntimeError):
    """The sweep failed; ``partial`` holds rank 0's raw results of the configs finished."""

    def __init__(self, message: str, partial: dict | None = None):
        super().__init__(message)
        self.partial = partial or {"results": [], "ag_rs_reduce": "?"}


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_rank() -> int:
    """This process's rank on its machine (torchrun's LOCAL_RANK; RANK otherwise)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def _init(cfg: dict, local: int, **kwargs) -> None:
    import torch
    import torch.distributed as dist

    from pcie_a2a.bench.device import rank_device

    if cfg["backend"] == "cuda":
        dev = rank_device(local, cfg["device_count"])
        torch.cuda.set_device(dev)
        if cfg["pg_backend"] == "nccl":
            # binds the communicator to this GPU: barriers and object collectives use it
            kwargs["device_id"] = torch.device("cuda", dev)
    dist.init_process_group(
        cfg["pg_backend"], timeout=datetime.timedelta(seconds=cfg["pg_timeout"]), **kwargs
    )


def _sweep(cfg: dict):
    """The rank-side sweep: bench/worker.py's, or the one ``cfg["sweep_module"]`` names
    (``--op allreduce``: bench/allreduce_worker.py)."""
    import importlib

    return importlib.import_module(cfg.get("sweep_module", "pcie_a2a.bench.worker")).run_sweep


def _split_nodes(cfg: dict, world: int) -> None:
    """--nodes N: this rank's Buffers see nodes of world/N ranks (bench/nodes.py)."""
    from pcie_a2a.bench.nodes import ENV, local_world

    per_node = local_world(cfg, world)
    if per_node is not None:
        os.environ[ENV] = str(per_node)


def _child(rank: int, world: int, port: int, cfg: dict, results) -> None:
    faulthandler.enable()  # a crashing rank prints where it was
    os.environ["OMP_NUM_THREADS"] = str(cfg["threads"])
    _split_nodes(cfg, world)
    try:
        import torch.distributed as dist

        run_sweep = _sweep(cfg)
        _init(cfg, rank, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            out = run_sweep(cfg, emit=lambda kind, value: results.put((kind, rank, value)))
        finally:
            dist.destroy_process_group()
        results.put(("ok", rank, out))
    except BaseException as exc:
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_torchrun(cfg: dict) -> dict | None:
    """Runs this process as one rank of torchrun's group; rank 0 returns the raw results."""
    import torch.distributed as dist

    run_sweep = _sweep(cfg)
    _split_nodes(cfg, int(os.environ["WORLD_SIZE"]))
    _init(cfg, local_rank(), init_method="env://")
    try:
        return run_sweep(cfg)
    finally:
        dist.destroy_process_group()


def _cleanup_shm(pids: list[int]) -> None:
    shm = Path(env.shm_dir())
    for pid in pids:
        for seg in shm.glob(f"pcie_a2a.{pid}_*"):
            seg.unlink(missing_ok=True)


def run_spawned(cfg: dict, world: int) -> dict:
    """Spawns ``world`` ranks, runs the sweep, returns rank 0's raw results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world, port, cfg, results),
            daemon=True,
            name=f"pcie-a2a-bench-rank{r}",
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + cfg["timeout"]
    got: dict[int, tuple] = {}
    partial: dict = {"results": [], "ag_rs_reduce": "?"}
    error: str | None = None
    try:
        for p in procs:
            p.start()
        while len(got) < world:
            if time.monotonic() > deadline:
                error = f"the sweep did not finish within --timeout {cfg['timeout']:.0f} s"
                break
            try:
                kind, rank, value = results.get(timeout=0.5)
                if kind == "meta":
                    partial.update(value)
                    continue
                if kind == "result":
                    partial["results"].append(value)
                    continue
                got[rank] = (kind, value)
                if kind == "error":
                    error = f"rank {rank} failed: {value}"
                    break
            except queue_mod.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode != 0 and r not in got
                ]
                if dead and results.empty():
                    error = f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})"
                    break
    except KeyboardInterrupt:
        error = "interrupted"
        raise
    finally:
        end = time.monotonic() + (_GRACE_S if error is None else 2.0)
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        killed = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if killed or error:
            _cleanup_shm([p.pid for p in procs if p.pid is not None])
        results.close()
        results.join_thread()
    if error:
        raise BenchError(error, partial)
    return got[0][1]


def run(cfg: dict, world: int) -> dict | None:
    if under_torchrun():
        return run_torchrun(cfg)
    if world < 1:
        raise BenchError(f"--world: got {world}; allowed: a positive int")
    where = "" if cfg["backend"] == "cpu" else f", {cfg['device_count']} GPUs"
    if cfg.get("nodes", 1) > 1:
        where += f", {cfg['nodes']} simulated nodes of {world // cfg['nodes']}"
    print(
        f"[bench] spawning {world} ranks ({cfg['pg_backend']} on 127.0.0.1{where})",
        file=sys.stderr,
        flush=True,
    )
    return run_spawned(cfg, world)
