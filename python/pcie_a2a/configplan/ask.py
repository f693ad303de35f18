"""``--config "FLAGS"``: a configuration named in SGLang's or vLLM's own launch flags, read
into the plan's :class:`.configs.Config` and evaluated like every candidate (runs or not and
why, predicted curve, memory), including layouts that use fewer GPUs than the box has.

The flags are read by hand (importing the frameworks' parsers would pull in torch); the
ones that do not change the layout are listed as not modelled rather than guessed at.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace

from .configs import Config
from .predict import Env
from .run import Result, evaluate

# flag -> (framework, field): the spellings each framework's parser accepts (SGLang's
# --tp and --dp are argparse abbreviations of --tp-size and --dp-size; its --pp is
# ambiguous there, so it is not read); "" = both frameworks' flag
_INT_FLAGS = {
    "--tp-size": ("sglang", "tp"),
    "--tp": ("sglang", "tp"),
    "--pp-size": ("sglang", "pp"),
    "--dp-size": ("sglang", "dp"),
    "--dp": ("sglang", "dp"),
    "--attn-dp-size": ("sglang", "attn_dp"),
    "--ep-size": ("sglang", "ep"),
    "--ep": ("sglang", "ep"),
    "--ep-num-redundant-experts": ("sglang", "redundant"),
    "--tensor-parallel-size": ("vllm", "tp"),
    "-tp": ("vllm", "tp"),
    "--pipeline-parallel-size": ("vllm", "pp"),
    "-pp": ("vllm", "pp"),
    "--data-parallel-size": ("vllm", "dp"),
    "-dp": ("vllm", "dp"),
    "-dcp": ("vllm", "dcp"),
    "--dcp-size": ("sglang", "dcp"),
    "--decode-context-parallel-size": ("", "dcp"),  # both frameworks spell it so
}
_BOOL_FLAGS = {
    "--enable-dp-attention": ("sglang", "dp_attention"),
    "--enable-expert-parallel": ("vllm", "ep_on"),
    "-ep": ("vllm", "ep_on"),
}
_STR_FLAGS = {
    "--moe-a2a-backend": ("sglang", "a2a"),
    "--kv-cache-dtype": ("", "kv"),
}


@dataclass
class Asked:
    flags: str
    framework: str
    config: Config | None
    result: Result | None
    kv_dtype: str
    notes: list[str] = field(default_factory=list)  # flags read but not modelled
    refused: str = ""  # why the flags name no configuration the plan can evaluate


def parse(flags: str) -> tuple[str, dict, list[str]]:
    """(framework, values, notes) of a flag string; ValueError for a malformed one."""
    try:
        words = shlex.split(flags)
    except ValueError as exc:
        raise ValueError(f"--config: got {flags!r}: {exc}") from None
    vals: dict = {}
    seen: set[str] = set()
    notes: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if "=" in w and not w.startswith("-"):  # NAME=value environment
            if w.split("=", 1)[0] == "PCIE_A2A_VLLM":
                vals["pcie_vllm"] = w.split("=", 1)[1] not in ("", "0")
                seen.add("vllm")
            i += 1
            continue
        name, _, inline = w.partition("=") if w.startswith("--") else (w, "", "")
        if name in _INT_FLAGS or name in _STR_FLAGS:
            fw, key = _INT_FLAGS.get(name) or _STR_FLAGS[name]
            if inline:
                value = inline
            elif i + 1 < len(words):
                value = words[i + 1]
                i += 1
            else:
                raise ValueError(f"--config: {name} needs a value")
            if name in _INT_FLAGS:
                try:
                    vals[key] = int(value)
                except ValueError:
                    raise ValueError(
                        f"--config: {name}: got {value!r}; allowed: an int >= 1"
                    ) from None
                if vals[key] < (0 if key == "redundant" else 1):
                    raise ValueError(f"--config: {name}: got {value!r}; allowed: an int >= 1")
            else:
                vals[key] = value
            if fw:
                seen.add(fw)
        elif name in _BOOL_FLAGS:
            fw, key = _BOOL_FLAGS[name]
            vals[key] = True
            seen.add(fw)
        elif w.startswith("-"):
            notes.append(f"{w}: not a layout flag, not modelled")
        i += 1
    if len(seen) > 1:
        raise ValueError(
            f"--config: got {flags!r}, which mixes SGLang flags (--tp-size, --ep-size, "
            "--dp-size, ...) and vLLM flags (--tensor-parallel-size, --enable-expert-parallel, "
            "...); allowed: one framework's flags"
        )
    if not seen:
        raise ValueError(
            f"--config: got {flags!r}; allowed: SGLang flags (--tp-size N [--ep-size N] "
            "[--dp-size N --enable-dp-attention] [--pp-size N] [--moe-a2a-backend pcie]) or "
            "vLLM flags (--tensor-parallel-size N [--data-parallel-size N] "
            "[--enable-expert-parallel] [--pipeline-parallel-size N])"
        )
    return seen.pop(), vals, notes


def to_config(framework: str, v: dict, payload: str) -> tuple[Config | None, str]:
    """The plan's configuration for the flags, or (None, why none)."""
    cfg, why = _layout(framework, v, payload)
    if cfg is not None and v.get("dcp", 1) > 1:
        cfg = replace(cfg, dcp=v["dcp"])  # the rules say whether it nests
    return cfg, why


def _layout(framework: str, v: dict, payload: str) -> tuple[Config | None, str]:
    tp, pp, dp = v.get("tp", 1), v.get("pp", 1), v.get("dp", 1)
    red = v.get("redundant", 0)
    if framework == "sglang":
        attn_dp = v.get("attn_dp", dp if v.get("dp_attention") else 1)
        if dp > 1 and not v.get("dp_attention") and "attn_dp" not in v:
            return None, (
                f"--dp-size {dp} without --enable-dp-attention runs {dp} independent copies of "
                f"the model (each --tp-size {tp}); the plan models one copy: ask for it with "
                f"--tp-size {tp} and multiply its throughput by {dp}"
            )
        ep = v.get("ep", 1)
        a2a = v.get("a2a", "none")
        if a2a == "pcie":
            return Config(tp, pp, attn_dp, tp, "pcie_a2a", red, payload), ""
        if a2a != "none":
            return None, f"--moe-a2a-backend {a2a}: not modelled (none and pcie are)"
        if ep == 1:
            if attn_dp > 1:
                # DP attention, MoE TP over all ranks: tokens gathered before, scattered after
                return Config(tp, pp, attn_dp, 1, "ag-rs", red), ""
            return Config(tp, pp), ""
        comm = "ag-rs" if attn_dp > 1 else "allreduce"
        return Config(tp, pp, attn_dp, ep, comm, red), ""
    # vLLM: the MoE spans TP x DP; --enable-expert-parallel makes it EP over all of them
    gpus = tp * dp
    if not v.get("ep_on"):
        if dp > 1:
            return None, (
                f"--data-parallel-size {dp} without --enable-expert-parallel: the MoE as TP "
                f"over {gpus} GPUs under DP attention is not modelled; add "
                "--enable-expert-parallel"
            )
        return Config(tp, pp), ""
    if dp == 1:
        return Config(tp, pp, 1, tp, "allreduce"), ""
    comm = "pcie_a2a" if v.get("pcie_vllm") else "ag-rs"
    return Config(gpus, pp, dp, gpus, comm, 0, payload), ""


def explain(
    flags: str, env: Env, gpus: int, results: list[Result], cap_ms: float | None = None
) -> Asked:
    framework, vals, notes = parse(flags)
    kv = vals.get("kv", "")
    kv_dtype = "fp8" if kv.startswith("fp8") else "bf16" if kv in ("", "auto", "bf16") else kv
    if kv_dtype not in ("fp8", "bf16"):
        raise ValueError(f"--config: --kv-cache-dtype {kv}: allowed auto, bf16, fp8, fp8_e4m3")
    payload = next((r.config.payload for r in results), "fp8")
    cfg, why = to_config(framework, vals, payload)
    asked = Asked(flags, framework, cfg, None, kv_dtype, notes, why)
    if cfg is None:
        return asked
    kv_bytes = 1.0 if kv_dtype == "fp8" else 2.0
    same = next(
        (r for r in results if r.config == cfg and kv_bytes == env.kv_bytes and r.modelled),
        None,
    )
    if same is None:
        e = env if kv_bytes == env.kv_bytes else replace(env, kv_bytes=kv_bytes, _loads={})
        same = evaluate(e, cfg, gpus, cap_ms=cap_ms)
    asked.result = same
    return asked
