"""``AllReduce``: the PCIe all-reduce for the attention's tensor parallelism.

Every rank of ``group`` constructs one with the same arguments; then
``ar.all_reduce(x, out=None, residual=None)`` sums x over the group (plus ``residual`` if
given, fused) and ``ar.all_reduce_rmsnorm(x, weight, eps, residual)`` also applies the
fused add + RMSNorm the frameworks run after the attention's all-reduce. Both are
``torch.library`` ops (``pcie_a2a::all_reduce``, ``all_reduce_out``, ``all_reduce_rmsnorm``)
with fake kernels, so ``torch.compile`` and CUDA graphs see them.

Per call, by size (every rank decides from the same element count, so all agree):
one-shot, two-shot, or NCCL (gloo on the CPU) above the hand-over size; see
:mod:`pcie_a2a.allreduce.tuning`. Every rank gets the same bits: fp32 sums in rank order
(csrc/core/allreduce_math.h). Protocol, ownership proof: csrc/core/allreduce_wire.h.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import weakref
from typing import Any

import torch
import torch.distributed as dist

from pcie_a2a import _native, env
from pcie_a2a.allreduce import decisions as dec
from pcie_a2a.allreduce import reference, tuning

logger = logging.getLogger("pcie_a2a.allreduce")

_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
_ALGO = {"one_shot": 1, "two_shot": 2}
_ROUTES = ("one_shot", "two_shot", "fallback")
_HANDLES = itertools.count(1)
_REGISTRY: weakref.WeakValueDictionary[int, AllReduce] = weakref.WeakValueDictionary()


def lookup(handle: int) -> AllReduce:
    """The communicator behind a handle (what the torch.library ops carry)."""
    comm = _REGISTRY.get(handle)
    if comm is None:
        raise RuntimeError(f"pcie_a2a all-reduce handle {handle} is closed or was never created")
    return comm


def _fail(kind: type[Exception], arg: str, got: Any, allowed: str) -> Exception:
    return kind(f"{arg}: got {got}; allowed: {allowed}")


class AllReduce:
    """Tensor-parallel all-reduce communicator for one process group.

    Args:
        group: torch.distributed process group (None: the default group). Used to
            bootstrap and for the calls handed over to NCCL/gloo (see ``fallback_group``).
        max_bytes: the largest call (bytes per rank) this communicator handles itself; sizes
            its segments (``2 x world x max_bytes`` per rank, half in end-barrier mode).
            Larger calls, and calls above the hand-over size, go to the fallback group.
        dtype: torch.bfloat16 or torch.float16, or a tuple of both (a framework hook that
            does not know the model's dtype yet: every call takes its tensor's dtype).
        backend: ``"auto"`` (``PCIE_A2A_BACKEND``, else ``"cpu"``), ``"cpu"`` or ``"cuda"``
            (explicit opt-in: the kernels have not yet run on a GPU, see the README).
        device: CUDA device index for ``backend="cuda"`` (default: the current device).
        algorithm: ``"auto"`` (by size), ``"one_shot"``, ``"two_shot"`` (every call up to
            max_bytes), or ``"fallback"`` (always NCCL/gloo). Default: PCIE_A2A_ALLREDUCE_ALGO.
        handover_bytes / one_shot_max_bytes: replace the thresholds of
            :mod:`pcie_a2a.allreduce.tuning` (default: env, bench table, probe, defaults).
        end_barrier: end every call with a barrier and use one buffer instead of two
            (csrc/core/allreduce_wire.h). Default: PCIE_A2A_ALLREDUCE_END_BARRIER, else off.
        pair_direction: ``[world][world]`` of "push"/"pull" (sender first) replacing the
            planner's directions.
        timeout_s: deadline of every wait (PCIE_A2A_TIMEOUT_S, else 30 s); a peer that does
            not arrive raises PeerTimeoutError naming it.
        fallback_group: the group of the handed-over calls (default: ``group``), e.g. the
            NCCL group when ``group`` is a gloo group used for bootstrap.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        max_bytes: int,
        dtype: torch.dtype | tuple[torch.dtype, ...] = torch.bfloat16,
        *,
        backend: str = "auto",
        device: int | None = None,
        algorithm: str | None = None,
        handover_bytes: int | None = None,
        one_shot_max_bytes: int | None = None,
        end_barrier: bool | None = None,
        pair_direction: list[list[str]] | None = None,
        timeout_s: float | None = None,
        fallback_group: dist.ProcessGroup | None = None,
    ):
        self._backend = None
        self._closed = True
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("AllReduce needs an initialised torch.distributed process group")
        self.group = group if group is not None else dist.group.WORLD
        self.fallback_group = fallback_group if fallback_group is not None else self.group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 16:
            raise _fail(ValueError, "max_bytes", repr(max_bytes), "an int >= 16")
        if max_bytes % 16:
            raise _fail(ValueError, "max_bytes", max_bytes, "a multiple of 16 bytes")
        if max_bytes // 2 > _native_limits()["max_elements"]:
            raise _fail(
                ValueError, "max_bytes", max_bytes, f"<= {2 * _native_limits()['max_elements']}"
            )
        dtypes = tuple(dtype) if isinstance(dtype, (tuple, list)) else (dtype,)
        if not dtypes or any(d not in _DTYPES for d in dtypes):
            raise _fail(
                TypeError, "dtype", dtype, "torch.bfloat16, torch.float16 or a tuple of them"
            )
        algorithm = env.allreduce_algorithm() if algorithm is None else algorithm
        if algorithm not in env.ALLREDUCE_ALGORITHMS:
            raise _fail(
                ValueError, "algorithm", repr(algorithm), ", ".join(env.ALLREDUCE_ALGORITHMS)
            )
        for name, v in (
            ("handover_bytes", handover_bytes),
            ("one_shot_max_bytes", one_shot_max_bytes),
        ):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise _fail(ValueError, name, repr(v), "None or an int >= 0")
        if timeout_s is None:
            timeout_s = env.timeout_s(30.0)
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise _fail(ValueError, "timeout_s", repr(timeout_s), "a positive number of seconds")
        if end_barrier is None:
            end_barrier = bool(env.allreduce_end_barrier())
        if self.world > _native_limits()["max_world"]:
            raise _fail(ValueError, "group size", self.world, f"<= {_native_limits()['max_world']}")
        self.backend = _choose_backend(backend)
        self.max_bytes = max_bytes
        self.dtypes = dtypes
        self.dtype = dtypes[0]
        self.algorithm = algorithm
        self.end_barrier = bool(end_barrier)
        self.timeout_s = float(timeout_s)
        self._seq = 0
        self._failed: str | None = None
        self._calls = dict.fromkeys(_ROUTES, 0)
        self._last_bytes = [0] * self.world
        self._total_bytes = [0] * self.world
        explicit = dec.explicit(pair_direction) if pair_direction is not None else None
        if explicit is not None and explicit.world != self.world:
            raise _fail(
                ValueError,
                "pair_direction",
                f"{explicit.world} rows",
                f"{self.world} (the group size)",
            )
        self._bootstrap(explicit, handover_bytes, one_shot_max_bytes, device)
        self.handle = next(_HANDLES)
        _REGISTRY[self.handle] = self
        self._closed = False

    # ---- construction ------------------------------------------------------------------
    def _gather(self, obj: Any) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _check_all(self, error: str | None, what: str) -> None:
        errors = [e for e in self._gather(error) if e]
        if errors:
            raise RuntimeError(f"AllReduce bootstrap failed while {what}: " + "; ".join(errors))

    def _bootstrap(self, explicit, handover_bytes, one_shot_max_bytes, device) -> None:
        config = {
            "max_bytes": self.max_bytes,
            "dtype": [str(d) for d in self.dtypes],
            "backend": self.backend,
            "algorithm": self.algorithm,
            "end_barrier": self.end_barrier,
            "handover_bytes": handover_bytes,
            "one_shot_max_bytes": one_shot_max_bytes,
            "pair_direction": None if explicit is None else explicit.direction,
        }
        uid = f"{os.getpid()}_{secrets.token_hex(6)}"
        gathered = self._gather((config, uid))
        for key, mine in config.items():
            values = [g[0][key] for g in gathered]
            if any(v != mine for v in values):
                raise ValueError(
                    f"AllReduce argument {key!r} differs between ranks: {values}; "
                    "every rank must pass the same value"
                )
        prefix = f"pcie_a2a.{gathered[0][1]}"
        dtype_name = str(self.dtype).removeprefix("torch.")
        if self.backend == "cuda":
            from pcie_a2a.allreduce.cuda import CudaBackend

            self._backend = CudaBackend(
                self.group, self.rank, self.world, self.max_bytes, self.end_barrier, explicit,
                self._check_all, self._gather, device,
            )  # fmt: skip
            decisions = self._backend.decisions
        else:
            from pcie_a2a.allreduce.cpu import CpuBackend

            decisions = explicit or dec.all_push(self.world, "CPU shared memory: push")
            self._backend = CpuBackend(
                prefix, self.rank, self.world, self.max_bytes, self.end_barrier, decisions,
                self._check_all,
            )  # fmt: skip
        self.device = self._backend.device
        self.decisions = decisions
        # Rank 0 decides the thresholds and every rank uses them: the route of a call must
        # be the same on every rank (environment variables could differ between processes).
        mine = None
        if self.rank == 0:
            cls = "cpu" if self.backend == "cpu" else tuning.topology_class(decisions.path_classes)
            mine = tuning.choose(
                self.backend, self.world, dtype_name, cls, decisions.measured, self.max_bytes,
                handover_bytes, one_shot_max_bytes,
            )  # fmt: skip
        self.thresholds: tuning.Thresholds = self._gather(mine)[0]
        if not self._backend.active and self.rank == 0:
            logger.warning(
                "pcie_a2a all-reduce: every call of this %d-rank group goes to the fallback (%s)",
                self.world,
                self._backend.why_inactive,
            )

    # ---- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Releases the segments (device memory and IPC mappings on the CUDA backend).
        Not collective: call it on every rank once every rank's last call has completed
        (e.g. after a barrier). Safe to call twice; calls after it raise."""
        if not self._closed:
            self._closed = True
            _REGISTRY.pop(self.handle, None)
            backend, self._backend = self._backend, None
            backend.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> AllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this AllReduce is closed")
        if self._failed is not None:
            raise RuntimeError(
                f"this AllReduce failed earlier and cannot be used: {self._failed}; "
                "close it and create a new one on every rank"
            )

    def check(self) -> None:
        """Raises a failure a kernel recorded asynchronously (CUDA backend: a peer that timed
        out, aborted or disagreed); the CPU backend raises in the call itself."""
        self._check_usable()
        self._protocol(self._backend.check)

    def _protocol(self, fn, *args) -> None:
        """Runs a protocol step; a peer failure other than an abort breaks the communicator."""
        t = _native.transport()
        try:
            fn(*args)
        except t.PeerAbortedError:
            raise  # every rank skipped that call together: the communicator stays usable
        except t.PeerError as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            raise

    # ---- routing -----------------------------------------------------------------------
    def route(self, numel: int) -> str:
        """Where a call of ``numel`` elements of this dtype goes: one_shot, two_shot or
        fallback. The same on every rank for the same element count."""
        nbytes = numel * 2  # bf16 and fp16
        if self.algorithm == "fallback" or not self._backend.active:
            return "fallback"
        if numel <= 0 or nbytes % 16 or nbytes > self.max_bytes:
            return "fallback"
        if self.algorithm in _ALGO:
            return self.algorithm
        return self.thresholds.route(nbytes)

    def should_use(self, x: torch.Tensor) -> bool:
        """True when ``all_reduce(x)`` would not hand the call over (the frameworks ask
        before calling: their ``should_custom_ar``)."""
        return (
            isinstance(x, torch.Tensor)
            and x.dtype in self.dtypes
            and x.device == self.device
            and x.is_contiguous()
            and self.route(x.numel()) != "fallback"
        )

    # ---- calls -------------------------------------------------------------------------
    def all_reduce(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sum of x over the group, plus ``residual`` if given (``dtype(dtype(sum) +
        residual)``, the bits of the unfused ``all_reduce(x) + residual``). ``out`` may be
        x itself (in place) or residual."""
        if self._closed or not all(
            isinstance(t, torch.Tensor) for t in (x, out, residual) if t is not None
        ):
            self._validate(x, out, residual)  # the op's schema would refuse it without an abort
        if out is None:
            return torch.ops.pcie_a2a.all_reduce(x, self.handle, residual)
        torch.ops.pcie_a2a.all_reduce_out(x, out, self.handle, residual)
        return out

    def all_reduce_rmsnorm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, residual_out) with residual_out = all_reduce(x) + residual (or the
        all-reduce alone without residual) and normed its RMSNorm over the last dimension
        times ``weight``: vLLM's and SGLang's ``fused_add_rms_norm`` after the all-reduce
        (numerics: csrc/core/allreduce_math.h)."""
        if self._closed or not all(
            isinstance(t, torch.Tensor) for t in (x, weight, residual) if t is not None
        ):
            self._validate(x, None, residual, weight)
        return torch.ops.pcie_a2a.all_reduce_rmsnorm(x, self.handle, residual, weight, float(eps))

    def _check_tensor(self, t: Any, name: str, like: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise _fail(TypeError, name, type(t).__name__, "a torch.Tensor")
        if t.dtype not in self.dtypes:
            raise _fail(
                TypeError,
                f"{name}.dtype",
                t.dtype,
                " or ".join(str(d) for d in self.dtypes) + " (the communicator's dtype)",
            )
        if t.device != self.device:
            raise _fail(ValueError, f"{name}.device", t.device, f"{self.device}")
        if not t.is_contiguous():
            raise _fail(ValueError, name, "a non-contiguous tensor", "a contiguous tensor")
        if like is not None and t.dtype != like.dtype:
            raise _fail(TypeError, f"{name}.dtype", t.dtype, f"{like.dtype} (the dtype of x)")
        if like is not None and t.shape != like.shape:
            raise _fail(
                ValueError, f"{name}.shape", list(t.shape), f"{list(like.shape)} (the shape of x)"
            )
        return t

    def _validate(self, x, out, residual, weight=None):
        """Checks the arguments; if they are bad while the call would be ours, tells the
        peers (abort) before raising, so that they raise at once instead of timing out."""
        numel = x.numel() if isinstance(x, torch.Tensor) else 0
        route = self.route(numel) if not self._closed and self._failed is None else "fallback"
        try:
            self._check_usable()
            self._check_tensor(x, "x")
            if residual is not None:
                self._check_tensor(residual, "residual", x)
            if out is not None:
                self._check_tensor(out, "out", x)
            if weight is not None:
                self._check_tensor(weight, "weight")
                if weight.dtype != x.dtype:
                    raise _fail(
                        TypeError, "weight.dtype", weight.dtype, f"{x.dtype} (the dtype of x)"
                    )
                if x.dim() < 1 or weight.dim() != 1 or weight.numel() != x.shape[-1]:
                    raise _fail(
                        ValueError,
                        "weight.shape",
                        list(weight.shape),
                        f"[{x.shape[-1] if x.dim() else '?'}] (the last dimension of x)",
                    )
                if weight.numel() % 8:
                    raise _fail(
                        ValueError,
                        "weight.shape",
                        list(weight.shape),
                        "a hidden size that is a multiple of 8",
                    )
        except (TypeError, ValueError):
            if route != "fallback":
                self._seq += 1
                try:
                    self._protocol(self._backend.abort, self._seq, self.timeout_s)
                except _native.transport().PeerError:
                    pass  # recorded in self._failed: the next call says so; the caller's
                    # mistake is the error to raise now
            raise
        return route

    def _run(self, x, out, residual) -> torch.Tensor:
        route = self._validate(x, out, residual)
        if out is None:
            out = torch.empty_like(x)
        self._calls[route] += 1
        if route == "fallback":
            self._fallback(x, out, residual)
            return out
        self._seq += 1
        self._protocol(
            self._backend.run, self._seq, _ALGO[route], _DTYPES[x.dtype], x, residual, out,
            self.timeout_s,
        )  # fmt: skip
        self._record()
        return out

    def _run_rmsnorm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        route = self._validate(x, None, residual, weight)
        r = torch.empty_like(x)
        self._calls[route] += 1
        if route == "fallback":
            self._fallback(x, r, None)
            return reference.add_rmsnorm(r, residual, weight, eps)
        self._seq += 1
        self._protocol(
            self._backend.run, self._seq, _ALGO[route], _DTYPES[x.dtype], x, None, r,
            self.timeout_s,
        )  # fmt: skip
        self._record()
        residual_out = torch.empty_like(x)
        self._backend.rmsnorm(r, residual, weight, eps, _DTYPES[x.dtype], r, residual_out)
        return r, residual_out

    def _fallback(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None) -> None:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        if x.numel():
            dist.all_reduce(out, group=self.fallback_group)
        if residual is not None:
            out.add_(residual)

    def _record(self) -> None:
        last = self._backend.last_bytes()
        self._last_bytes = last
        self._total_bytes = [a + b for a, b in zip(self._total_bytes, last)]

    # ---- stats -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Calls per route, bytes this rank wrote into each rank's segment (last call and in
        total; the entry of this rank is its staging copy), the thresholds and the per-pair
        decisions with where they come from."""
        me = self.rank
        return {
            "backend": self.backend,
            "active": bool(self._backend.active) if self._backend else False,
            "why_inactive": self._backend.why_inactive if self._backend else "closed",
            "calls": dict(self._calls),
            "last_bytes_per_rank": list(self._last_bytes),
            "total_bytes_per_rank": list(self._total_bytes),
            "total_wire_bytes": sum(b for r, b in enumerate(self._total_bytes) if r != me),
            "thresholds": {
                "one_shot_max_bytes": self.thresholds.one_shot_max,
                "handover_bytes": self.thresholds.handover,
                "source": self.thresholds.source,
            },
            "end_barrier": self.end_barrier,
            "decisions": self.decisions.to_dict(),
        }


def _choose_backend(backend: str) -> str:
    if backend not in ("auto", "cpu", "cuda"):
        raise _fail(ValueError, "backend", repr(backend), "'auto', 'cpu', 'cuda'")
    if backend == "auto":
        # As for Buffer: the CUDA kernels have run only in the CPU model of CUDA (README),
        # so "auto" stays on the CPU until they have run on a GPU; "cuda" is an opt-in.
        backend = env.backend() or "cpu"
    if backend == "cuda":
        from pcie_a2a.allreduce.cuda import unavailable_reason

        why = unavailable_reason()
        if why:
            raise ValueError(f"backend='cuda' is not available here: {why}; use backend='cpu'")
    return backend


def _native_limits() -> dict:
    from pcie_a2a.allreduce.cpu import native

    mod = native()
    return {"max_world": int(mod.MAX_WORLD), "max_elements": int(mod.MAX_ELEMENTS)}
