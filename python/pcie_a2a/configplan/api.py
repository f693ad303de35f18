"""One call from inputs to the evaluated plan: :func:`make_plan`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import topo as topo_src
from .calibrate import fit
from .exchange import Exchanges
from .gpus import Gpu, get_gpu, identify
from .imbalance import Routing, load_routing, zipf
from .measured import Measured, read_bench, read_probe
from .models import ModelShape, load_model
from .predict import Env
from .run import Recommendation, Result, evaluate_all, recommend
from .stacks import Stack, get_stack
from .tables import Tables, load_tables


@dataclass(frozen=True)
class Inputs:
    model: str = "kimi-k2.6"
    gpus: int | None = None
    gpu: str | None = None
    topo: str | None = None
    probe: str | None = None
    bench: str | None = None
    context: int = 4096
    stack: str = "vllm-tuned"
    kv_dtype: str = "bf16"
    routing: str | None = None
    skew: float = 0.0
    seed: int = 0
    redundant: int = 0
    payload: str = "fp8"
    tables: str | None = None

    def check(self) -> None:
        if self.gpus is not None and (not isinstance(self.gpus, int) or self.gpus < 1):
            raise ValueError(f"--gpus: got {self.gpus!r}; allowed: an int >= 1")
        if not isinstance(self.context, int) or self.context < 0:
            raise ValueError(f"--context: got {self.context!r}; allowed: an int >= 0 (tokens)")
        if self.kv_dtype not in ("bf16", "fp8"):
            raise ValueError(f"--kv-cache-dtype: got {self.kv_dtype!r}; allowed: bf16, fp8")
        if self.payload not in ("bf16", "fp8"):
            raise ValueError(f"--payload: got {self.payload!r}; allowed: bf16, fp8")
        if not isinstance(self.redundant, int) or self.redundant < 0:
            raise ValueError(f"--redundant-experts: got {self.redundant!r}; allowed: an int >= 0")
        if self.routing and self.skew:
            raise ValueError("--routing and --skew: give one of them, not both")


@dataclass
class PlanResult:
    inputs: Inputs
    model: ModelShape
    gpu: Gpu
    num_gpus: int
    stack: Stack
    tables: Tables
    routing: Routing
    env: Env
    results: list[Result]
    recommendation: Recommendation
    topology_note: str
    measured: Measured
    notes: list[str] = field(default_factory=list)


def make_plan(inp: Inputs) -> PlanResult:
    inp.check()
    model = load_model(inp.model)
    tables = load_tables(inp.tables) if inp.tables else Tables()
    notes: list[str] = []
    gpu_hint = get_gpu(inp.gpu) if inp.gpu else None
    gen_hint = gpu_hint.pcie_gen if gpu_hint else 5
    topo, carried, topo_note = topo_src.resolve(inp.topo, inp.gpus, gen_hint)
    gpu = gpu_hint
    if gpu is None:
        names = {g.name for g in topo.gpus if g.name}
        found = {identify(n) for n in names} - {None}
        if len(found) == 1:
            gpu = found.pop()
            notes.append(f"GPU from the topology's names: {gpu.name}")
        else:
            gpu = get_gpu("rtx-pro-6000")
            notes.append(
                "GPU not named by the topology"
                + (f" ({', '.join(sorted(names))})" if names else "")
                + f": {gpu.name} assumed (--gpu to choose)"
            )
    n = inp.gpus or topo.num_gpus
    if n > topo.num_gpus:
        raise ValueError(f"--gpus {n}: the topology ({topo.source}) has {topo.num_gpus} GPUs")
    if n < topo.num_gpus:
        notes.append(f"planning {n} of the topology's {topo.num_gpus} GPUs (GPU0..GPU{n - 1})")
    measured = Measured()
    if inp.probe:
        read_probe(inp.probe, measured)
    elif carried is not None:
        measured.probe, measured.probe_source = carried, topo.source
    elif inp.topo and not Path(inp.topo).is_file():
        companion = topo_src.probe_companion(inp.topo)
        if companion is not None:
            read_probe(str(companion), measured)
            notes.append(f"fixture {inp.topo}: its measured pairs {companion.name} used as --probe")
    if inp.bench:
        read_bench(inp.bench, measured)
    notes += measured.notes
    if inp.routing:
        routing = load_routing(inp.routing, model.experts)
    else:
        routing = zipf(model.experts, inp.skew, inp.seed)
    stack = fit(get_stack(inp.stack), tables)
    link_gen = gpu.pcie_gen
    exchanges = Exchanges(topo, measured, link_gen)
    env = Env(
        model,
        gpu,
        stack,
        tables,
        routing,
        inp.context,
        1.0 if inp.kv_dtype == "fp8" else 2.0,
        exchanges,
    )
    results = evaluate_all(env, n, inp.redundant, inp.payload)
    notes += exchanges.notes
    return PlanResult(
        inp,
        model,
        gpu,
        n,
        stack,
        tables,
        routing,
        env,
        results,
        recommend(results),
        topo_note,
        measured,
        notes,
    )
