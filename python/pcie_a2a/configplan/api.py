"""One call from inputs to the evaluated plan: :func:`make_plan`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..gpus import Gpu, get_gpu, identify
from . import topo as topo_src
from .calibrate import fit
from .exchange import Exchanges
from .imbalance import Routing, load_routing, zipf
from .measured import Measured, read_bench, read_probe
from .models import ModelShape, load_model
from .nodes import evaluate_nodes, parse_nic
from .predict import Env
from .run import Recommendation, Result, evaluate_all, recommend
from .stacks import Stack, get_stack, load_stack
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
    output: int = 1024
    stack: str = "vllm-tuned"
    stack_file: str | None = None
    kv_dtype: str = "bf16"
    routing: str | None = None
    skew: float = 0.0
    seed: int = 0
    redundant: int = 0
    payload: str = "fp8"
    tables: str | None = None
    max_tpot_ms: float = 50.0
    config: str | None = None  # a configuration in SGLang's or vLLM's own flags
    nodes: int | None = None  # N nodes of this box (--nodes); 1 = the box alone
    nic: str | None = None  # the NICs joining them (--nic SPEC, configplan.nodes.parse_nic)

    def check(self) -> None:
        if self.gpus is not None and (not isinstance(self.gpus, int) or self.gpus < 1):
            raise ValueError(f"--gpus: got {self.gpus!r}; allowed: an int >= 1")
        if not isinstance(self.context, int) or self.context < 0:
            raise ValueError(f"--context: got {self.context!r}; allowed: an int >= 0 (tokens)")
        if not isinstance(self.output, int) or self.output < 1:
            raise ValueError(f"--output: got {self.output!r}; allowed: an int >= 1 (tokens)")
        tpot = self.max_tpot_ms
        if isinstance(tpot, bool) or not isinstance(tpot, (int, float)) or not tpot > 0:
            raise ValueError(f"--max-tpot-ms: got {tpot!r}; allowed: a number > 0 (ms)")
        if self.kv_dtype not in ("bf16", "fp8"):
            raise ValueError(f"--kv-cache-dtype: got {self.kv_dtype!r}; allowed: bf16, fp8")
        if self.payload not in ("bf16", "fp8"):
            raise ValueError(f"--payload: got {self.payload!r}; allowed: bf16, fp8")
        if not isinstance(self.redundant, int) or self.redundant < 0:
            raise ValueError(f"--redundant-experts: got {self.redundant!r}; allowed: an int >= 0")
        if self.routing and self.skew:
            raise ValueError("--routing and --skew: give one of them, not both")
        nodes = self.nodes
        if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int)):
            raise ValueError(f"--nodes: got {nodes!r}; allowed: an int >= 1")
        if nodes is not None and not 1 <= nodes <= 64:  # a sanity bound, not NCCL's
            raise ValueError(f"--nodes: got {nodes!r}; allowed: 1 to 64")
        if self.nic is not None:
            if nodes is None:
                raise ValueError(
                    f"--nic: got {self.nic!r} without --nodes; allowed: with --nodes N"
                )
            parse_nic(self.nic)  # a bad SPEC is an error even where one node ignores it
        elif nodes is not None and nodes > 1:
            raise ValueError(
                f"--nodes {nodes}: needs --nic SPEC, the NICs per node (e.g. 2x100g-roce); "
                "nothing is assumed about the network"
            )


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
    assumed: list[str] = field(default_factory=list)  # said in the first lines
    asked: object | None = None  # the --config explanation (configplan.ask.Asked)
    nodes: object | None = None  # --nodes N > 1: configplan.nodes.NodesPlan

    @property
    def max_model_len(self) -> int:
        return self.inputs.context + self.inputs.output


def make_plan(inp: Inputs) -> PlanResult:
    inp.check()
    if inp.nodes == 1:  # one node is the box itself: the same plan as without --nodes
        inp = replace(inp, nodes=None, nic=None)
    model = load_model(inp.model)
    tables = load_tables(inp.tables) if inp.tables else Tables()
    notes: list[str] = []
    gpu_hint = get_gpu(inp.gpu) if inp.gpu else None
    gen_hint = gpu_hint.pcie_gen if gpu_hint else 5
    topo, carried, topo_note = topo_src.resolve(inp.topo, inp.gpus, gen_hint)
    gpu = gpu_hint
    gpu_named = gpu is not None
    if gpu is None:
        names = {g.name for g in topo.gpus if g.name}
        found = {identify(n) for n in names} - {None}
        if len(found) == 1:
            gpu = found.pop()
            gpu_named = True
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
    assumed: list[str] = []
    if inp.probe:
        read_probe(inp.probe, measured)
    elif carried is not None:
        measured.probe, measured.probe_source = carried, topo.source
    elif inp.topo:
        path = Path(inp.topo)
        companion = (
            topo_src.companion_of(path) if path.is_file() else topo_src.probe_companion(inp.topo)
        )
        if companion is not None:
            read_probe(str(companion), measured)
            notes.append(f"{inp.topo}: its measured pairs {companion} used as --probe")
    if not measured.probe:
        assumed.append(
            "pair bandwidths and latencies (pcie_a2a exchanges, PP sends) are the topology "
            "planner's estimates from the link classes, not measured (--probe FILE)"
        )
    if inp.bench:
        read_bench(inp.bench, measured)
    notes += measured.notes
    if inp.routing:
        routing = load_routing(inp.routing, model.experts)
    else:
        routing = zipf(model.experts, inp.skew, inp.seed)
    stack = fit(load_stack(inp.stack_file) if inp.stack_file else get_stack(inp.stack), tables)
    if stack.mtp is not None and stack.mtp.model and stack.mtp.model != model.name:
        assumed.append(
            f"MTP: stack {stack.name}'s draft and accepted length ({stack.mtp.label}) were "
            f"measured on {stack.mtp.model}, not on {model.name} (your own: --stack-file "
            "with 'mtp')"
        )
    link_gen = gpu.pcie_gen
    exchanges = Exchanges(topo, measured, link_gen)
    env = Env(
        model,
        gpu,
        stack,
        tables,
        routing,
        inp.context + inp.output // 2,  # the mean context of a decode step
        1.0 if inp.kv_dtype == "fp8" else 2.0,
        exchanges,
        held_context=inp.context + inp.output,
    )
    if not gpu_named:
        assumed.append(f"the GPU: {gpu.name} (--gpu)")
    if topo_note.startswith("no topology"):
        assumed.append("the box: " + topo_note)
    if gpu.key != "rtx-pro-6000":
        assumed.append(
            "collective tables: measured on 8x RTX PRO 6000, scaled to this GPU's link capacity"
        )
    assumed.append(
        "kernel efficiencies (memory 0.85, tensor 0.6) and launch gaps are assumptions "
        "(docs/plan.md); the stack's host costs are fitted"
    )
    results = evaluate_all(env, n, inp.redundant, inp.payload, inp.max_tpot_ms)
    asked = None
    if inp.config:
        from .ask import explain

        asked = explain(inp.config, env, n, results, inp.max_tpot_ms)
    notes += exchanges.notes
    rec = recommend(results, cap_ms=inp.max_tpot_ms, band=stack.band)
    nodes = None
    if inp.nodes:
        nic = parse_nic(inp.nic)
        nodes = evaluate_nodes(env, n, inp.nodes, nic, inp.payload, inp.max_tpot_ms, rec.best)
        assumed.append(
            f"across {inp.nodes} nodes: the NIC numbers ({nodes.gbps_kind}) and a NCCL round "
            "from other boxes; nothing was measured across nodes of these boxes (section "
            f"'across {inp.nodes} nodes')"
        )
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
        rec,
        topo_note,
        measured,
        notes,
        assumed,
        asked,
        nodes,
    )
