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
* MoE communication is the configuration's (:mod:`.configs`), not the stack's;
* ``mtp``: speculative decoding (MTP / EAGLE) off, or ``draft_tokens`` drafts verified per
  request and step and ``accept_len`` tokens emitted per request and step (:class:`Mtp`):
  a decode step then runs ``C x (1 + draft_tokens)`` rows, the weights read once and each
  request's KV cache once, and the time per output token is the step over ``accept_len``.
  The draft model's own passes are not a term: on a stack fitted on MTP numbers they sit in
  the fitted host costs. Only a stack whose accepted length has a cited source ships with
  MTP (``vllm-tuned-mtp``); a user gives theirs in ``--stack-file`` (``"mtp"``).

Only ``step_us`` and ``request_us`` are fitted, on the stack's calibration numbers
(:mod:`.calibrate`), which also gives the leave-one-out residuals every predicted figure's
band comes from. A user states their own stack with ``--stack-file`` (:func:`load_stack`).
"""

from __future__ import annotations

import json
import math
import re
import shlex
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

_TUNED_V4_MTP = (
    "local-inference-lab/rtx6kpro models/kimi-k26-v4.md (2026-05), Kimi K2.6 INT4, 8x RTX "
    "PRO 6000, vLLM TP8 DCP1 as vllm-tuned, EAGLE3 MTP on (3 draft tokens), context 0 "
    "(research/field_2026.md s1: 122.0 / 2245.8)"
)
_TUNED_V3_MTP = (
    "local-inference-lab/rtx6kpro models/kimi-k26-v3.md, the same tuned vLLM stack, DCP=1 + "
    "MTP=3 with the Kimi 2.6 draft lightseekorg/kimi-k2.6-eagle3-mla, context 0 "
    "(research/field_2026.md s1: 110.1 / 2406.5)"
)
_KIMI_DRAFT = "lightseekorg/kimi-k2.6-eagle3-mla"
_KIMI_ACCEPT_SRC = (
    "local-inference-lab/rtx6kpro models/kimi-k26-v4.md, 'Kimi Draft Acceptance Notes', KIMI "
    "DCP1 (vLLM SpecDecoding metrics over the decode matrix): per-position acceptance "
    "0.645, 0.393, 0.240 of 3 draft tokens, so 1 + 0.645 + 0.393 + 0.240 = 2.278 tokens per "
    "step (= 1 + 3 x the mean acceptance 0.426); draft lightseekorg/kimi-k2.6-eagle3-mla "
    "(kimi-k26-v3.md)"
)

FRAMEWORKS = {"sglang": "SGLang 0.5.23", "vllm": "vLLM 0.33.0"}
ALLREDUCES = ("nccl", "custom", "pcie_a2a")


@dataclass(frozen=True)
class Mtp:
    """Speculative decoding: ``draft_tokens`` drafts verified per request and decode step,
    ``accept_len`` tokens emitted per request and step on average (the verified token plus
    the accepted drafts: 1 <= accept_len <= 1 + draft_tokens), measured on ``model``."""

    draft_tokens: int
    accept_len: float
    source: str
    method: str = ""  # what drafts (e.g. "EAGLE3 draft lightseekorg/kimi-k2.6-eagle3-mla")
    model: str = ""  # the plan's built-in name of the checkpoint accept_len was measured on

    def __post_init__(self) -> None:
        check_mtp(self.draft_tokens, self.accept_len, "mtp")

    @property
    def label(self) -> str:
        how = f" ({self.method})" if self.method else ""
        return f"{self.draft_tokens} draft tokens, {self.accept_len:g} tokens per step{how}"


def check_mtp(draft_tokens, accept_len, where: str) -> None:
    k = draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{where}.draft_tokens: got {k!r}; allowed: an int >= 1")
    a = accept_len
    ok = isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)
    if not ok or not 1.0 <= a <= 1 + k:
        raise ValueError(
            f"{where}.accept_len: got {a!r}; allowed: a number from 1 to 1 + draft_tokens "
            f"({1 + k}): the verified token plus the accepted drafts"
        )


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
    mtp: Mtp | None = None  # speculative decoding; None: off

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
            self._mtp_part(),
        ]

    def _mtp_part(self) -> Part:
        if self.mtp is None:
            return Part("MTP", "off", "each decode step emits one token per request", "-")
        return Part(
            "MTP",
            self.mtp.label,
            f"a decode step runs C x {1 + self.mtp.draft_tokens} rows (weights read once, "
            f"each request's KV cache once) and emits {self.mtp.accept_len:g} tokens per "
            "request; the draft model's passes, weights and KV cache are not a term (on a "
            "stack fitted on MTP numbers the passes sit in the fitted host costs)",
            self.mtp.source,
        )

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
            "vllm-tuned-mtp",
            "vllm",
            "vLLM, community-tuned as vllm-tuned, with EAGLE3 speculative decoding (3 draft "
            f"tokens, {_KIMI_DRAFT}); host costs fitted on the MTP numbers, so they hold the "
            "draft model's passes",
            "custom",
            (
                CalPoint(_k(8), 1, 122.0, _TUNED_V4_MTP),
                CalPoint(_k(8), 128, 2245.8, _TUNED_V4_MTP),
                CalPoint(_k(8), 1, 110.1, _TUNED_V3_MTP),
                CalPoint(_k(8), 128, 2406.5, _TUNED_V3_MTP),
            ),
            env=_NCCL_TUNED_ENV,
            flags={
                "vllm": (
                    "--speculative-config",
                    shlex.quote(
                        json.dumps(
                            {"method": "eagle3", "model": _KIMI_DRAFT, "num_speculative_tokens": 3}
                        )
                    ),
                ),
                "sglang": (
                    *("--speculative-algorithm", "EAGLE3"),
                    *("--speculative-draft-model-path", _KIMI_DRAFT),
                    *("--speculative-num-steps", "3", "--speculative-eagle-topk", "1"),
                    *("--speculative-num-draft-tokens", "4"),
                ),
            },
            notes=(
                _TUNED_NOTE,
                "the draft model and its accepted length are Kimi K2.6's; kimi-k26-v3.md "
                "reports no acceptance, so its MTP numbers are taken at v4's 2.278",
            ),
            mtp=Mtp(3, 2.278, _KIMI_ACCEPT_SRC, f"EAGLE3 draft {_KIMI_DRAFT}", "kimi-k2.6"),
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


_FILE_KEYS = (
    "name",
    "framework",
    "description",
    "allreduce",
    "cuda_graphs",
    "env",
    "flags",
    "mtp",
)


def load_stack(path: str) -> Stack:
    """A user's stack from JSON: ``framework``, ``allreduce``, ``cuda_graphs``, optional
    ``env`` (list), ``flags`` ({framework: [flags]}), and either ``points`` (calibration
    numbers on Kimi K2.6 INT4 / 8x RTX PRO 6000: ``[{"tp": 8, "ep": 1, "comm": "tp",
    "concurrency": 1, "tok_s": 92.4, "source": "..."}]``, at least two) or ``like`` (a
    shipped stack whose fitted framework costs and band it reuses, and its MTP part unless
    the file says), and optional ``mtp``: ``{"draft_tokens": 3, "accept_len": 2.3,
    "source": "..."}`` (speculative decoding on; ``null``: off)."""
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
    mtp = STACKS[like].mtp if like is not None else None
    if "mtp" in doc:
        mtp = _load_mtp(doc["mtp"], f"--stack-file {path}: mtp")
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
        mtp=mtp,
    )


def _load_mtp(value, where: str) -> Mtp | None:
    if value is None:
        return None
    keys = {"draft_tokens", "accept_len", "source", "method"}
    if not isinstance(value, dict) or not {"draft_tokens", "accept_len"} <= set(value):
        raise ValueError(
            f"{where}: got {value!r}; allowed: null (off) or {{'draft_tokens': int >= 1, "
            "'accept_len': number, 'source': '...', 'method': '...'}"
        )
    if set(value) - keys:
        raise ValueError(
            f"{where}: unknown keys {sorted(set(value) - keys)}; allowed: {', '.join(sorted(keys))}"
        )
    check_mtp(value["draft_tokens"], value["accept_len"], where)
    src = value.get("source", "given in the stack file (no source stated)")
    return Mtp(
        value["draft_tokens"], float(value["accept_len"]), str(src), str(value.get("method", ""))
    )
