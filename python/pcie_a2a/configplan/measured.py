"""The adapter for measured numbers: probe and bench files whose numbers replace modelled
ones. Kept small and separate so that new formats plug in here and nowhere else.

``--probe FILE`` (per GPU pair; feeds the topology planner, so every pcie_a2a exchange the
plan predicts uses these numbers instead of the planner's table):

* ``{"format": "pcie_a2a.probe", "version": 1, ...}`` or ``p2pBandwidthLatencyTest``
  output: read by :func:`pcie_a2a.topology.load_probe`;
* any other JSON object with ``"pairs": [{"src": i, "dst": j, ...}, ...]`` whose entries
  carry some of ``p2p_gbps``, ``p2p_us``, ``staged_gbps``, ``staged_us``,
  ``p2p_possible``, or per-direction numbers ``push_gbps``/``write_gbps`` and
  ``pull_gbps``/``read_gbps`` (the pair then plans with the faster direction, or with the
  one named by ``"direction": "push"|"pull"``). Unknown keys are ignored;
* optional ``"exchanges": [{"tokens_per_rank": T, "dispatch_us": .., "combine_us": ..,
  "payload": "fp8"|"bf16", "measured": true|false}, ...]``: dispatch/combine times of the
  whole box; they replace the planner's prediction for pcie_a2a (``measured: false``
  entries, e.g. another tool's predictions, are labelled as predictions).

``--bench FILE``: a ``pcie-a2a bench --backend cuda`` JSON. Its p50 dispatch and combine
times of ``pcie_a2a`` (and of the ``a2a`` NCCL ``all_to_all_single`` baseline) per tokens
per rank replace the modelled pcie_a2a and NCCL all-to-all exchanges when its shape (hidden,
experts, top-k, world) is the model's and the EP size's. CPU-backend bench files are
refused: CPU-transport timings say nothing about a GPU step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pcie_a2a.topology import Probe, load_probe
from pcie_a2a.topology.probe import FORMAT as PROBE_FORMAT
from pcie_a2a.topology.probe import PairMeasurement

from .tables import Curve


@dataclass(frozen=True)
class Exchange:
    """Dispatch and combine time (µs) against tokens per rank, for one method and payload."""

    dispatch: Curve
    combine: Curve
    measured: bool
    source: str
    world: int | None = None
    shape: tuple[int, int, int] | None = None  # hidden, experts, top-k

    @property
    def kind(self) -> str:
        return "measured" if self.measured else "predicted"


@dataclass
class Measured:
    probe: Probe | None = None
    probe_source: str = ""
    # (method, payload) -> Exchange; method "pcie_a2a" or "a2a" (NCCL all_to_all_single)
    exchanges: dict[tuple[str, str], Exchange] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def exchange(self, method: str, payload: str, world: int, shape) -> Exchange | None:
        ex = self.exchanges.get((method, payload))
        if ex is None:
            return None
        if ex.world is not None and ex.world != world:
            return None
        if ex.shape is not None and tuple(ex.shape) != tuple(shape):
            return None
        return ex


def _pair_from_generic(row: dict[str, Any], where: str) -> PairMeasurement:
    def num(*keys: str) -> float | None:
        for k in keys:
            v = row.get(k)
            if v is not None:
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                    raise ValueError(f"{where}: {k}={v!r}; expected a number >= 0")
                return float(v)
        return None

    p2p = num("p2p_gbps")
    push, pull = num("push_gbps", "write_gbps"), num("pull_gbps", "read_gbps")
    direction = row.get("direction")
    if direction not in (None, "push", "pull"):
        raise ValueError(f"{where}: direction={direction!r}; allowed push, pull")
    if p2p is None and (push is not None or pull is not None):
        if direction == "push" and push is not None:
            p2p = push
        elif direction == "pull" and pull is not None:
            p2p = pull
        else:
            p2p = max(v for v in (push, pull) if v is not None)
    possible = row.get("p2p_possible")
    return PairMeasurement(
        p2p_gbps=p2p,
        p2p_us=num("p2p_us", "push_us", "write_us"),
        staged_gbps=num("staged_gbps"),
        staged_us=num("staged_us"),
        p2p_possible=None if possible is None else bool(possible),
    )


def _curve(points: list[tuple[float, float]], source: str) -> Curve:
    return Curve(tuple(sorted(points)), source)


def _exchanges(entries: Any, source: str) -> dict[tuple[str, str], Exchange]:
    if not isinstance(entries, list):
        raise ValueError(f"{source}: 'exchanges' must be a list")
    grouped: dict[tuple[str, bool], list[tuple[float, float, float]]] = {}
    for k, e in enumerate(entries):
        try:
            t, d, c = float(e["tokens_per_rank"]), float(e["dispatch_us"]), float(e["combine_us"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{source}: exchanges[{k}]: expected tokens_per_rank, dispatch_us, combine_us"
            ) from None
        payload = e.get("payload", "fp8")
        if payload not in ("fp8", "bf16"):
            raise ValueError(f"{source}: exchanges[{k}].payload={payload!r}; allowed fp8, bf16")
        grouped.setdefault((payload, bool(e.get("measured", False))), []).append((t, d, c))
    out = {}
    for (payload, measured), pts in grouped.items():
        src = f"dispatch/combine times from {source}"
        out[("pcie_a2a", payload)] = Exchange(
            _curve([(t, d) for t, d, _ in pts], src),
            _curve([(t, c) for t, _, c in pts], src),
            measured,
            src,
        )
    return out


def read_probe(path: str, into: Measured) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.lstrip().startswith("{"):
        into.probe, into.probe_source = load_probe(path), path
        return
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--probe {path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--probe {path}: expected a JSON object")
    if doc.get("format") == PROBE_FORMAT and doc.get("version") == 1:
        into.probe, into.probe_source = Probe.from_json(text, path), path
    elif "pairs" in doc:
        pairs = {}
        for k, row in enumerate(doc["pairs"]):
            where = f"--probe {path}: pairs[{k}]"
            if not isinstance(row, dict) or "src" not in row or "dst" not in row:
                raise ValueError(f"{where}: expected an object with src and dst")
            pairs[(int(row["src"]), int(row["dst"]))] = _pair_from_generic(row, where)
        into.probe, into.probe_source = Probe(pairs=pairs, source=path), path
        if doc.get("format"):
            into.notes.append(
                f"--probe {path}: format {doc.get('format')!r} read by its 'pairs' entries"
            )
    elif "exchanges" not in doc:
        raise ValueError(
            f"--probe {path}: expected a {PROBE_FORMAT} document, a JSON object with 'pairs' "
            "or 'exchanges', or p2pBandwidthLatencyTest output"
        )
    if "exchanges" in doc:
        into.exchanges.update(_exchanges(doc["exchanges"], f"--probe {path}"))


def read_bench(path: str, into: Measured) -> None:
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--bench {path}: not JSON ({exc})") from None
    try:
        cfg, results, world = doc["config"], doc["results"], int(doc["machine"]["world"])
        shape = (int(cfg["hidden"]), int(cfg["experts"]), int(cfg["topk"]))
        backend = cfg.get("backend", "cpu")
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"--bench {path}: not a pcie-a2a bench JSON (expected config, machine.world, results)"
        ) from None
    if backend != "cuda":
        raise ValueError(
            f"--bench {path}: backend {backend!r}; allowed: a '--backend cuda' run (CPU-transport "
            "timings do not predict a GPU step)"
        )
    # (method, payload) -> tokens -> (routing rank, dispatch, combine); uniform routing is
    # preferred (what the plan models without --routing), then the first one listed.
    pts: dict[tuple[str, str], dict[float, tuple[int, float, float]]] = {}
    for res in results:
        if "methods" not in res:
            continue
        pref = 0 if res.get("routing") == "uniform" else 1
        for method, m in res["methods"].items():
            if method not in ("pcie_a2a", "a2a") or "phases" not in m:
                continue
            payload = res["payload"] if method == "pcie_a2a" else "bf16"
            ph = m["phases"]
            row = (pref, float(ph["dispatch"]["p50_us"]), float(ph["combine"]["p50_us"]))
            by_tokens = pts.setdefault((method, payload), {})
            t = float(res["tokens"])
            if t not in by_tokens or row[0] < by_tokens[t][0]:
                by_tokens[t] = row
    if not pts:
        raise ValueError(f"--bench {path}: no finished pcie_a2a or a2a results")
    for (method, payload), by_tokens in pts.items():
        rows = [(t, d, c) for t, (_, d, c) in by_tokens.items()]
        src = f"--bench {path} (world {world}, p50 dispatch + combine)"
        into.exchanges[(method, payload)] = Exchange(
            _curve([(t, d) for t, d, _ in rows], src),
            _curve([(t, c) for t, _, c in rows], src),
            True,
            src,
            world,
            shape,
        )
