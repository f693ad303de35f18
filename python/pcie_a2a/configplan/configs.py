"""Parallel configurations, in SGLang's nesting: ``tp`` GPUs per pipeline stage, ``pp``
stages; attention split into ``attn_dp`` data-parallel groups of ``tp / attn_dp`` (TP
inside a group); the MoE split into ``ep`` expert-parallel ranks of ``tp / ep`` (MoE TP
inside a rank). ``comm`` says how tokens meet their experts:

=============  ================================================================================
``tp``         MoE TP only (ep = 1): every GPU runs a slice of every expert, one all-reduce
               after attention and one after the MLP.
``allreduce``  EP inside TP attention: every GPU has every token and runs only its experts;
               the all-reduce that follows the MLP sums them (SGLang ``--ep`` with
               ``--moe-a2a-backend none``; vLLM ``--enable-expert-parallel`` without DP).
``ag-rs``      DP attention + EP: all-gather the tokens before the MoE, reduce-scatter after
               (SGLang DP attention with a2a ``none``; vLLM's ``allgather_reducescatter``).
``a2a-nccl``   DP attention + EP: NCCL ``all_to_all_single`` dispatch and combine, one row
               per (token, expert), bf16 both ways.
``pcie_a2a``   EP with this package's dispatch/combine (a row per (token, rank), fp8 or bf16
               out, bf16 pre-reduced back). With DP attention each rank sends its own
               tokens; with TP attention (SGLang only) SGLang scatters the batch over the TP
               ranks before the MoE and gathers the outputs after it.
=============  ================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace

COMMS = ("tp", "allreduce", "ag-rs", "a2a-nccl", "pcie_a2a")
_COMM_LABEL = {
    "allreduce": "all-reduce",
    "ag-rs": "AG/RS",
    "a2a-nccl": "NCCL a2a",
    "pcie_a2a": "pcie_a2a",
}


@dataclass(frozen=True)
class Config:
    tp: int  # GPUs per pipeline stage (SGLang --tp-size)
    pp: int = 1
    attn_dp: int = 1
    ep: int = 1
    comm: str = "tp"
    redundant: int = 0
    payload: str = "fp8"  # pcie_a2a dispatch payload
    tried: bool = False  # a configuration users try, listed to show why it fails
    dcp: int = 1  # decode context parallelism: the KV cache split over dcp attention ranks
    kv_fp8: bool = False  # fp8 KV cache whatever the plan's --kv-cache-dtype

    def __post_init__(self) -> None:
        if self.comm not in COMMS:
            raise ValueError(f"comm {self.comm!r}: allowed {', '.join(COMMS)}")
        for name in ("tp", "pp", "attn_dp", "ep", "dcp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: got {v!r}; allowed: an int >= 1")
        if self.payload not in ("fp8", "bf16"):
            raise ValueError(f"payload {self.payload!r}: allowed fp8, bf16")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def attn_tp(self) -> int:
        return max(self.tp // self.attn_dp, 1)

    @property
    def moe_tp(self) -> int:
        return max(self.tp // self.ep, 1)

    @property
    def name(self) -> str:
        if self.tp == 1:
            base = f"PP{self.pp}" if self.pp > 1 else "1 GPU"
            return base
        if self.tp % self.attn_dp:
            att = f"TP{self.tp} DP{self.attn_dp}"  # does not nest: shown as typed
        elif self.attn_dp > 1:
            att = f"DP{self.attn_dp}" if self.attn_tp == 1 else f"TP{self.attn_tp}xDP{self.attn_dp}"
        else:
            att = f"TP{self.tp}"
        pp = f"xPP{self.pp}" if self.pp > 1 else ""
        tail = (f" DCP{self.dcp}" if self.dcp > 1 else "") + (" fp8-KV" if self.kv_fp8 else "")
        if self.comm == "tp":
            return att + pp + tail
        moe = f"+EP{self.ep} {_COMM_LABEL[self.comm]}"
        if self.redundant:
            moe += f" +{self.redundant} redundant"
        return att + pp + moe + tail


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    num_gpus: int, redundant: int = 0, payload: str = "fp8", kv_variants: bool = True
) -> list[Config]:
    """The configurations the plan evaluates on ``num_gpus`` GPUs (the expert-parallel ones
    with and without ``redundant`` extra expert slots; with TP attention, decode context
    parallelism over 2.. TP ranks; with ``kv_variants``, each single-stage layout also with
    an fp8 KV cache), then the ones users try that cannot run (each listed with its
    reason)."""
    out: list[Config] = []
    slots = (0, redundant) if redundant else (0,)  # with and without redundant experts
    for pp in _divisors(num_gpus):
        tp = num_gpus // pp
        if tp == 1:
            out.append(Config(1, pp))
            continue
        out.append(Config(tp, pp))
        out += [Config(tp, pp, 1, tp, "allreduce", r) for r in slots]
        # EP smaller than TP (MoE TP inside each EP rank): SGLang accepts it, vLLM cannot
        out += [Config(tp, pp, 1, e, "allreduce") for e in _divisors(tp)[1:-1]]
        if pp > 1:
            continue
        out += [Config(tp, 1, 1, tp, "pcie_a2a", r, payload) for r in slots]  # TP attention
        for dp in _divisors(tp)[1:]:
            for comm in ("ag-rs", "a2a-nccl", "pcie_a2a"):
                out += [Config(tp, 1, dp, tp, comm, r, payload) for r in slots]
    base = [c for c in out if c.pp == 1 and c.redundant == 0 and c.attn_dp == 1]
    base = [c for c in base if c.comm in ("tp", "allreduce") and c.ep in (1, c.tp)]
    for c in base:  # DCP: the MLA cache TP replicates, split over dcp of the TP ranks
        out += [replace(c, dcp=d) for d in _divisors(c.tp)[1:]]
    if kv_variants:
        out += [replace(c, kv_fp8=True) for c in list(out) if c.pp == 1 and not c.redundant]
    if num_gpus >= 4:
        n = num_gpus
        out += [
            Config(2 * n, 1, tried=True),  # more GPUs than the box has
            Config(n, 1, 1, 3, "allreduce", tried=True),  # --ep 3 inside --tp n
            Config(n, 1, 3, n, "ag-rs", tried=True),  # --dp 3 inside --tp n
        ]
        if n % 3 and n > 6:
            out.append(Config(6, 1, tried=True))  # 6 of the GPUs
        if redundant == 0:
            out.append(Config(n, 1, n, n, "pcie_a2a", 2 * n, payload, tried=True))
    return out
