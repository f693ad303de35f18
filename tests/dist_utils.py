"""One multi-process helper for every distributed test.

``run_ranks(world, fn, *args)`` spawns ``world`` processes, gives each a gloo process
group on a free loopback port, runs ``fn(rank, world, *args)`` and returns each rank's
outcome. Joins are bounded (a deadlock is the failure we expect to catch), every process
is torn down whatever happens, and exceptions come back with their type, message and
traceback so a test can assert on them.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_CTX = mp.get_context("spawn")


@dataclass
class Outcome:
    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""

    def unwrap(self) -> Any:
        if not self.ok:
            raise AssertionError(
                f"rank {self.rank} raised {self.error_type}: {self.error}\n{self.traceback}"
            )
        return self.value


def _by_value(value: Any) -> bytes:
    # The plain pickler copies tensor data into the bytes. Through the queue's own pickler
    # torch would pass a tensor's storage as a file descriptor that the parent fetches from
    # the child later, and a child that has exited by then loses the result
    # (FileNotFoundError in resource_sharer).
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            value = fn(rank, world, *args)
            queue.put(Outcome(rank, True, _by_value(value)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, never swallowed
        queue.put(Outcome(rank, False, None, type(exc).__name__, str(exc), traceback.format_exc()))


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Outcome]:
    """Runs fn(rank, world, *args) on `world` spawned ranks; returns outcomes by rank.

    A rank that does not report within `timeout` seconds (or dies without reporting)
    yields an Outcome with error_type "Hang" or "Died".
    """
    port = free_port()
    queue = _CTX.Queue()
    procs = [
        _CTX.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, Outcome] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                o = queue.get(timeout=min(remaining, 0.5))
                if o.ok:
                    o.value = pickle.loads(o.value)
                outcomes[o.rank] = o
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    for r, p in enumerate(procs):
        if r not in outcomes:
            kind = "Hang" if p.exitcode in (None, -9) else "Died"
            outcomes[r] = Outcome(r, False, None, kind, f"exit code {p.exitcode}")
    return [outcomes[r] for r in range(world)]


def run_ok(world: int, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Any]:
    """run_ranks, asserting every rank succeeded; returns their values."""
    return [o.unwrap() for o in run_ranks(world, fn, *args, timeout=timeout)]
