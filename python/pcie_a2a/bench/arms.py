"""The arms ``pcie-a2a bench`` times next to pcie_a2a / a2a / ag_rs, in the same loop:

* ``--direction``: one more pcie_a2a arm per forced direction (``pcie_a2a[push]``,
  ``pcie_a2a[pull]``), each on its own Buffer built with PCIE_A2A_DIRECTION set
  (``env.direction_forced``). ``auto`` is the ``pcie_a2a`` arm itself (the plan's per-pair
  decisions) and always runs: it is what the ratios divide by. A forced direction that
  the transport does not run on every pair (its ``Buffer.stats()["decisions"]`` say
  otherwise: the CPU transport, and the CUDA one until pull is in the protocol, push every
  pair) is not run and is reported as such, with the reason; it never runs push under the
  name pull.
* ``ar_ep`` (:class:`pcie_a2a.bench.methods.AllReduceEP`): SGLang's ``--ep`` with
  ``--moe-a2a-backend none``: its all-reduce (the combine phase) next to our
  dispatch+combine, medians and the ratio.
"""

from __future__ import annotations

import sys

from pcie_a2a import env

DIRECTIONS = ("auto", "push", "pull")
AR_EP = "ar_ep"
OURS = "pcie_a2a"


def arm_name(direction: str) -> str:
    return OURS if direction == "auto" else f"{OURS}[{direction}]"


def parse_directions(text: str) -> list[str]:
    """``--direction``: a comma list of auto, push, pull, or ``all``; auto always first.
    Exits 2 naming the option on anything else."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if items == ["all"]:
        items = list(DIRECTIONS)
    bad = [s for s in items if s not in DIRECTIONS] or ([] if items else [text])
    if bad:
        print(
            f"pcie-a2a bench: error: --direction: got {bad[0]!r}; allowed: a comma list of "
            f"{', '.join(DIRECTIONS)}, or all",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return ["auto", *dict.fromkeys(d for d in items if d != "auto")]


def why_not_direction(buf, direction: str, group) -> str | None:
    """Why ``buf`` does not run ``direction`` on every pair it sends on (the same answer on
    every rank), or None."""
    import torch.distributed as dist  # on the ranks only: the command line needs no torch

    why = None
    if direction != "auto":
        pairs = buf.stats()["decisions"]["pairs"]
        used = sorted({p["direction"] for p in pairs})
        if used and used != [direction]:
            why = (
                f"{direction} is not what the {buf.backend} transport runs on every pair: its "
                f"decisions say {', '.join(used)} ({pairs[0]['reason']})"
            )
    whys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(whys, why, group=group)
    return next((w for w in whys if w), None)


def direction_buffers(make_buffer, directions: list[str], group):
    """``[(direction, Buffer)]`` for the forced directions that run, and ``{arm: why}``
    for those that do not (their Buffers already closed)."""
    import torch.distributed as dist  # on the ranks only: the command line needs no torch

    built, unavailable = [], {}
    for d in directions:
        if d == "auto":
            continue
        world = dist.get_world_size(group)
        every_pair = [[d if s != r else "push" for r in range(world)] for s in range(world)]
        try:
            with env.direction_forced(d):
                buf = make_buffer(pair_direction=every_pair)
        except ValueError as exc:  # a transport that refuses the direction (CUDA: pull)
            unavailable[arm_name(d)] = f"{d}: {exc}"
            continue
        why = why_not_direction(buf, d, group)
        if why:
            buf.close()
            unavailable[arm_name(d)] = why
        else:
            built.append((d, buf))
    return built, unavailable


def summarize(ours_phases: dict, extra: dict, unavailable: dict) -> dict:
    """The arms of one config: p50s and the ratio to pcie_a2a's (auto) dispatch+combine."""
    base = max(ours_phases["disp+comb"]["p50_us"], 1e-9)
    out = {}
    for name, m in extra.items():
        ph = m["phases"]
        if name == AR_EP:
            ar = ph["combine"]["p50_us"]
            out[name] = {
                "allreduce_p50_us": ar,
                "allreduce_p99_us": ph["combine"]["p99_us"],
                "d+e+c_p50_us": ph["d+e+c"]["p50_us"],
                "allreduce_over_dispatch_combine": ar / base,
                "max_rel_err": m["max_rel_err"],
                "phases": ph,
            }
        else:
            dc = ph["disp+comb"]["p50_us"]
            out[name] = {
                "disp+comb_p50_us": dc,
                "disp+comb_p99_us": ph["disp+comb"]["p99_us"],
                "over_auto": dc / base,
                "max_rel_err": m["max_rel_err"],
                "phases": ph,
            }
    for name, why in unavailable.items():
        out[name] = {"unavailable": why}
    return out


def lines(summary: list[dict]) -> list[str]:
    """Per config: pcie_a2a (auto) dispatch+combine, then each forced direction and the EP
    all-reduce with its ratio to it (or why it did not run)."""
    out = []
    for res in summary:
        arms = res.get("arms")
        if not arms or "methods" not in res:
            continue
        dc = res["methods"][OURS]["phases"]["disp+comb"]["p50_us"]
        out.append(
            f"tokens={res['tokens']:<5} payload={res['payload']:<4} routing={res['routing']:<7}: "
            f"{OURS} (auto) dispatch+combine p50 {dc:.0f} µs"
        )
        for name, a in arms.items():
            if "unavailable" in a:
                out.append(f"  {name:<15} NOT RUN: {a['unavailable']}")
            elif name == AR_EP:
                out.append(
                    f"  {name:<15} all_reduce [tokens, hidden] bf16 p50 "
                    f"{a['allreduce_p50_us']:.0f} µs = "
                    f"{a['allreduce_over_dispatch_combine']:.3f}x auto dispatch+combine"
                )
            else:
                out.append(
                    f"  {name:<15} dispatch+combine p50 {a['disp+comb_p50_us']:.0f} µs = "
                    f"{a['over_auto']:.3f}x auto"
                )
    return out


def checks(summary: list[dict], tolerance: dict) -> list[str]:
    """Lines for arms whose output disagrees with the expected result."""
    bad = []
    for res in summary:
        for name, a in res.get("arms", {}).items():
            if "unavailable" in a:
                continue
            tol = tolerance["bf16"] if name == AR_EP else tolerance[res["payload"]]
            if not a["max_rel_err"] <= tol:
                bad.append(
                    f"CHECK FAILED: tokens={res['tokens']} payload={res['payload']} "
                    f"routing={res['routing']} {name}: max rel err {a['max_rel_err']:.3g} > {tol}"
                )
    return bad
