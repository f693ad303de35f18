"""Serving stacks as sets of parts, each with its measured or cited cost, and the framework
defaults a stack runs with (sourced).

A part enters the step model where its cost occurs (:mod:`.predict`):

* ``framework`` (SGLang 0.5.23 or vLLM 0.33.0): batch, chunk and memory defaults, the launch
  line, and two fitted host costs, ``step_us`` per forward pass (scheduling, input
  preparation, output processing) and ``request_us`` per request in it (per-request
  bookkeeping and sampling), charged once per micro-batch;
* ``cuda_graphs``: the gap each kernel launch leaves (graph replay or eager host launch,
  :class:`.tables.Tables`); pcie_a2a's rows always run eager, as their launch lines do;
* ``allreduce``: ``nccl`` (stock: the engines turn their custom all-reduce off above 2 PCIe
  GPUs), ``custom`` (a PCIe custom all-reduce up to ~56 KB, patched NCCL above) or
  ``pcie_a2a`` (``pcie_a2a.AllReduce`` with ``PCIE_A2A_ALLREDUCE=1``, costed as the measured
  PCIe one-shot all-reduce: it has never run on a GPU);
* MoE communication is the configuration's (:mod:`.configs`), not the stack's.

Only ``step_us`` and ``request_us`` are fitted, on the stack's calibration numbers
(:mod:`.calibrate`), which also gives the leave-one-out residuals every predicted figure's
band comes from. A user states their own stack with ``--stack-file`` (:func:`load_stack`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..gpus import Gpu
from .configs import Config

GIB = float(1 << 30)


@dataclass(frozen=True)
class CalPoint:
    config: Config
    concurrency: int | None  # None: the peak over concurrency
    tok_s: float
    source: str

    @property
    def tag(self) -> str:
        """A short name of the source (the page, or "stock")."""
        m = re.search(r"models/([\w.-]+)\.md", self.source)
        return m.group(1) if m else self.source.split(":")[0][:40]


_STOCK_SRC = (
    "the measurements that started this project: Kimi K2.6 INT4, 8x RTX PRO 6000, SGLang "
    "stock settings (research/field_2026.md s1; DESIGN.md s1). EP8 taken as --tp 8 --ep 8 "
    "with --moe-a2a-backend none, the EP that runs on these boxes (field_2026.md s1)"
)
_TUNED_V4 = (
    "local-inference-lab/rtx6kpro models/kimi-k26-v4.md (2026-05), Kimi K2.6 INT4, 8x RTX "
    "PRO 6000, vLLM TP8, PCIe custom all-reduce up to ~56 KB, patched NCCL, CUDA graphs, no "
    "MTP, context ~0 (research/field_2026.md s1)"
)
_TUNED_V3 = (
    "local-inference-lab/rtx6kpro models/kimi-k26-v3.md, the same tuned vLLM stack, no MTP "
    "(research/field_2026.md s1)"
)

FRAMEWORKS = {"sglang": "SGLang 0.5.23", "vllm": "vLLM 0.33.0"}
ALLREDUCES = ("nccl", "custom", "pcie_a2a")


@dataclass(frozen=True)
class Part:
    """One part of a stack: what it is set to, where its cost enters, and the source."""

    name: str
    value: str
    cost: str
    source: str


@dataclass(frozen=True)
class Stack:
    name: str
    framework: str  # sglang | vllm
    description: str
    allreduce: str  # nccl | custom | pcie_a2a
    points: tuple[CalPoint, ...]
    cuda_graphs: bool = True
    # what the numbers assume, per framework: environment and extra launch flags
    env: tuple[str, ...] = ()
    flags: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what a flag cannot say (a patch the numbers assume)
    step_us: float = 0.0
    request_us: float = 0.0
    fitted: bool = False
    residuals: tuple[tuple[str, float, float], ...] = ()  # (point, measured, fitted model)
    loo: tuple[tuple[str, float, float], ...] = ()  # (point, measured, fitted without it)
    like: str = ""  # a stack-file stack that reuses a shipped stack's fit and band

    def with_fit(self, step_us: float, request_us: float, residuals, loo) -> Stack:
        return replace(
            self,
            step_us=step_us,
            request_us=request_us,
            fitted=True,
            residuals=tuple(residuals),
            loo=tuple(loo),
        )

    def graphs(self, cfg: Config) -> bool:
        """pcie_a2a's integrations read counts on the host: its rows run eager (the launch
        lines say --disable-cuda-graph / --enforce-eager)."""
        return self.cuda_graphs and cfg.comm != "pcie_a2a"

    @property
    def band(self) -> tuple[float, float]:
        """(low, high) factors on a predicted figure: the range the measured value took
        relative to the prediction made without it (leave-one-out), 1 included."""
        errs = [pred / meas - 1 for _, meas, pred in self.loo] or [0.0]
        return 1 / (1 + max(max(errs), 0.0)), 1 / (1 + min(min(errs), 0.0))

    def parts(self) -> list[Part]:
        ar_cost = {
            "nccl": "each TP all-reduce from the measured NCCL table",
            "custom": "the measured PCIe custom all-reduce up to its limit, tuned NCCL above",
            "pcie_a2a": "pcie_a2a.AllReduce: assumed as fast as the measured PCIe one-shot "
            "all-reduce up to the same limit (never run on a GPU), NCCL above",
        }[self.allreduce]
        return [
            Part(
                "framework",
                FRAMEWORKS[self.framework],
                f"step_us {self.step_us:.0f} µs per forward pass + request_us "
                f"{self.request_us:.1f} µs per request in it (fitted)",
                "fitted on the calibration numbers; defaults from the framework's source",
            ),
            Part(
                "cuda graphs",
                "on" if self.cuda_graphs else "off",
                "each kernel's launch gap: graph replay or eager host launch (pcie_a2a rows: "
                "eager)",
                "tables kernel_gap_graph_us / kernel_gap_eager_us",
            ),
            Part("all-reduce", self.allreduce, ar_cost, "tables (custom_ar8, nccl8)"),
            Part("MoE communication", "per configuration", "the configuration's comm", "-"),
            Part("MTP", "off", "not modelled: speculative decoding is not a candidate", "-"),
        ]

    # ---- framework defaults -------------------------------------------------------------
    def max_batch(self, gpu: Gpu, cfg: Config) -> tuple[int, str]:
        """Most running requests per DP group the stack batches by default."""
        if self.framework == "sglang":
            mem = gpu.memory_gib
            if mem < 20:
                bs = 8
            elif mem < 60:
                bs = 160 if cfg.tp >= 4 else (48 if mem < 35 else 32)
            elif mem < 160:
                bs = 512 if cfg.tp >= 4 else 256
            else:
                bs = 512
            return bs, "SGLang 0.5.23 arg_groups/memory_hook.py: decode CUDA-graph max batch"
        bs = 1024 if gpu.memory_gib >= 70 else 256
        return bs, "vLLM 0.33.0 engine/arg_utils.py: default max_num_seqs (server)"

    def prefill_chunk(self, gpu: Gpu) -> tuple[int, str]:
        if self.framework == "sglang":
            mem = gpu.memory_gib
            n = 2048 if mem < 20 else 4096 if mem < 60 else 8192 if mem < 160 else 16384
            return n, "SGLang 0.5.23 arg_groups/memory_hook.py: chunked_prefill_size"
        n = 8192 if gpu.memory_gib >= 70 else 2048
        return n, "vLLM 0.33.0 engine/arg_utils.py: default max_num_batched_tokens (server)"

    def memory_budget(self, gpu: Gpu, cfg: Config) -> tuple[float, str]:
        """Bytes per GPU for weights, buffers and KV cache, and how it was computed."""
        total = gpu.memory_gib * GIB
        if self.framework == "sglang":
            chunk, _ = self.prefill_chunk(gpu)
            reserve = 512 + max(chunk, 2048) * 1.5 + cfg.tp * cfg.pp / 8 * 1024  # MiB
            if gpu.memory_gib > 60:
                reserve = max(reserve, 10 * 1024)
            return total - reserve * (1 << 20), (
                f"{gpu.memory_gib:g} GiB less SGLang's reserve {reserve / 1024:.1f} GiB "
                "(arg_groups/memory_hook.py: mem_fraction_static)"
            )
        return 0.9 * total, (
            f"0.9 x {gpu.memory_gib:g} GiB (vLLM --gpu-memory-utilization default 0.9)"
        )

    @property
    def activations_in_budget(self) -> bool:
        """vLLM's budget also holds the profiled activations; SGLang's reserve does."""
        return self.framework == "vllm"


def _k(tp: int, **kw) -> Config:
    return Config(tp, **kw)


_TUNED_NOTE = (
    "the numbers assume a PCIe custom all-reduce on 8 GPUs, which stock vLLM and SGLang turn "
    "off above 2 PCIe GPUs (vllm-project/vllm#31936): the community patch "
    "(local-inference-lab/rtx6kpro) or --stack pcie-a2a-allreduce (PCIE_A2A_ALLREDUCE=1)"
)
_NCCL_TUNED_ENV = ("NCCL_P2P_LEVEL=SYS",)  # rtx6kpro hardware/pcie-bandwidth.md (tables)

STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack(
            "sglang-stock",
            "sglang",
            "SGLang, stock settings: NCCL all-reduce (custom all-reduce is off above 2 PCIe "
            "GPUs, research/field_2026.md s2), CUDA graphs",
            "nccl",
            (
                CalPoint(_k(8), 1, 26.0, _STOCK_SRC),
                CalPoint(_k(8, ep=8, comm="allreduce"), 1, 65.0, _STOCK_SRC),
                CalPoint(_k(8, ep=8, comm="allreduce"), None, 961.0, _STOCK_SRC),
            ),
        ),
        Stack(
            "vllm-tuned",
            "vllm",
            "vLLM, community-tuned: PCIe custom all-reduce up to ~56 KB, patched NCCL above, "
            "CUDA graphs",
            "custom",
            (
                CalPoint(_k(8), 1, 92.4, _TUNED_V4),
                CalPoint(_k(8), 128, 2222.6, _TUNED_V4),
                CalPoint(_k(8), 1, 91.4, _TUNED_V3),
                CalPoint(_k(8), 128, 2310.2, _TUNED_V3),
            ),
            env=_NCCL_TUNED_ENV,
            notes=(_TUNED_NOTE,),
        ),
        Stack(
            "pcie-a2a-allreduce",
            "vllm",
            "vLLM with pcie_a2a.AllReduce as the TP all-reduce (PCIE_A2A_ALLREDUCE=1), tuned "
            "NCCL above it, CUDA graphs; framework costs and band those of vllm-tuned",
            "pcie_a2a",
            (),
            env=("PCIE_A2A_ALLREDUCE=1", *_NCCL_TUNED_ENV),
            like="vllm-tuned",
        ),
    )
}


def get_stack(name: str) -> Stack:
    if name not in STACKS:
        raise ValueError(f"--stack: got {name!r}; allowed: {', '.join(STACKS)}")
    return STACKS[name]


_FILE_KEYS = ("name", "framework", "description", "allreduce", "cuda_graphs", "env", "flags")


def load_stack(path: str) -> Stack:
    """A user's stack from JSON: ``framework``, ``allreduce``, ``cuda_graphs``, optional
    ``env`` (list), ``flags`` ({framework: [flags]}), and either ``points`` (calibration
    numbers on Kimi K2.6 INT4 / 8x RTX PRO 6000: ``[{"tp": 8, "ep": 1, "comm": "tp",
    "concurrency": 1, "tok_s": 92.4, "source": "..."}]``, at least two) or ``like`` (a
    shipped stack whose fitted framework costs and band it reuses)."""
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--stack-file {path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--stack-file {path}: got {type(doc).__name__}; allowed: an object")
    unknown = set(doc) - set(_FILE_KEYS) - {"points", "like"}
    if unknown:
        allowed = ", ".join((*_FILE_KEYS, "points", "like"))
        raise ValueError(f"--stack-file {path}: unknown keys {sorted(unknown)}; allowed: {allowed}")
    fw = doc.get("framework")
    if fw not in FRAMEWORKS:
        raise ValueError(f"--stack-file {path}: framework: got {fw!r}; allowed: sglang, vllm")
    ar = doc.get("allreduce", "nccl")
    if ar not in ALLREDUCES:
        raise ValueError(
            f"--stack-file {path}: allreduce: got {ar!r}; allowed: {', '.join(ALLREDUCES)}"
        )
    graphs = doc.get("cuda_graphs", True)
    if not isinstance(graphs, bool):
        raise ValueError(f"--stack-file {path}: cuda_graphs: got {graphs!r}; allowed: true, false")
    env = doc.get("env", [])
    if not isinstance(env, list) or not all(isinstance(e, str) and "=" in e for e in env):
        raise ValueError(f"--stack-file {path}: env: got {env!r}; allowed: ['NAME=value', ...]")
    flags = doc.get("flags", {})
    if not isinstance(flags, dict) or not all(
        k in FRAMEWORKS and isinstance(v, list) and all(isinstance(x, str) for x in v)
        for k, v in flags.items()
    ):
        raise ValueError(
            f"--stack-file {path}: flags: got {flags!r}; allowed: {{'sglang'|'vllm': [flags]}}"
        )
    like, points = doc.get("like"), doc.get("points")
    if (like is None) == (points is None):
        raise ValueError(f"--stack-file {path}: give exactly one of 'points' and 'like'")
    if like is not None and like not in STACKS:
        raise ValueError(f"--stack-file {path}: like: got {like!r}; allowed: {', '.join(STACKS)}")
    cal: list[CalPoint] = []
    if points is not None:
        if not isinstance(points, list) or len(points) < 2:
            raise ValueError(f"--stack-file {path}: points: at least two calibration numbers")
        for i, p in enumerate(points):
            try:
                cfg = Config(int(p.get("tp", 8)), 1, 1, int(p.get("ep", 1)), p.get("comm", "tp"))
                c = p.get("concurrency")
                tok = float(p["tok_s"])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"--stack-file {path}: points[{i}]: {exc}") from None
            if not tok > 0 or (c is not None and (not isinstance(c, int) or c < 1)):
                raise ValueError(
                    f"--stack-file {path}: points[{i}]: tok_s > 0 and concurrency an int >= 1"
                )
            cal.append(CalPoint(cfg, c, tok, str(p.get("source", path))))
    return Stack(
        str(doc.get("name", Path(path).stem)),
        fw,
        str(doc.get("description", f"from {path}")),
        ar,
        tuple(cal),
        cuda_graphs=graphs,
        env=tuple(env),
        flags={k: tuple(v) for k, v in flags.items()},
        like=like or "",
    )
