"""Files in and out of the balancer.

Loads in, as ``[layers, experts]`` token counts:

* SGLang's expert-distribution recorder (``--expert-distribution-recorder-mode stat``):
  the ``.pt`` it dumps holds ``logical_count`` ``[buffered steps, layers, experts]``
  (summed here over steps); a ``.json`` with a ``logical_count`` list is read the same way
  (what SGLang's ``--init-expert-location`` accepts);
* ours (:func:`write_loads`, ``Buffer.expert_load`` windows): ``{"format":
  "pcie_a2a.expert_load", "version": 1, "loads": [[...]], "source_loads": [[[...]]]}``,
  ``source_loads [layers, world, experts]`` optional (each source rank's counts).

Placements out: ours (``pcie_a2a.placements``: one :class:`~pcie_a2a.Placement` document
per layer, replica choice table included) and SGLang's ``--init-expert-location`` file,
``{"physical_to_logical_map": [[...] per layer]}`` (nothing else: SGLang passes the keys
to ``ExpertLocationMetadata.init_by_mapping`` as arguments), physical expert ``p`` on EP
rank ``p // slots_per_rank``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..placement import Placement

LOAD_FORMAT = "pcie_a2a.expert_load"
PLACEMENTS_FORMAT = "pcie_a2a.placements"
VERSION = 1


def _counts(value: Any, path: str, key: str) -> np.ndarray:
    try:
        a = np.asarray(value.tolist() if hasattr(value, "tolist") else value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: {key} is not a numeric array") from None
    if a.ndim < 2:
        raise ValueError(f"{path}: {key} has shape {a.shape}; allowed: [..., layers, experts]")
    a = a.reshape(-1, *a.shape[-2:]).sum(axis=0)
    if not np.all(np.isfinite(a)) or a.min(initial=0) < 0:
        raise ValueError(f"{path}: {key} has negative or non-finite counts")
    return a


def read_loads(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray | None]:
    """(``loads [layers, experts]``, ``share [layers, world, experts]`` or None)."""
    p = os.fspath(path)
    if p.endswith(".pt"):
        import torch

        try:
            doc = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"{p}: not a torch file SGLang's recorder writes: {exc}") from None
    else:
        try:
            with open(p, encoding="utf-8") as f:
                doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{p}: got a {type(doc).__name__}; allowed: a dict with 'logical_count'")
    if "logical_count" in doc:
        return _counts(doc["logical_count"], p, "logical_count"), None
    if doc.get("format") == LOAD_FORMAT and doc.get("version") == VERSION and "loads" in doc:
        loads = _counts(doc["loads"], p, "loads")
        share = None
        if doc.get("source_loads") is not None:
            src = np.asarray(doc["source_loads"], dtype=np.float64)
            if src.ndim != 3 or src.shape[0] != loads.shape[0] or src.shape[2] != loads.shape[1]:
                raise ValueError(
                    f"{p}: source_loads has shape {src.shape}; allowed: "
                    f"[{loads.shape[0]}, world, {loads.shape[1]}]"
                )
            total = src.sum(axis=1, keepdims=True)
            share = np.where(total > 0, src / np.maximum(total, 1e-300), 1.0 / src.shape[1])
        return loads, share
    raise ValueError(
        f"{p}: keys {sorted(doc)[:6]}; allowed: SGLang's recorder output (logical_count) or a "
        f"{LOAD_FORMAT!r} version {VERSION} document"
    )


def write_loads(
    path: str | os.PathLike, loads: np.ndarray, source_loads: np.ndarray | None = None
) -> None:
    doc: dict[str, Any] = {
        "format": LOAD_FORMAT,
        "version": VERSION,
        "loads": np.asarray(loads).tolist(),
    }
    if source_loads is not None:
        doc["source_loads"] = np.asarray(source_loads).tolist()
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


def write_placements(
    path: str | os.PathLike, placements: Sequence[Placement], layers: Sequence[int]
) -> None:
    doc = {
        "format": PLACEMENTS_FORMAT,
        "version": VERSION,
        "layers": list(layers),
        "placements": [p.to_dict() for p in placements],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


def read_placements(path: str | os.PathLike) -> dict[int, Placement]:
    """Layer -> Placement from our placements file."""
    p = os.fspath(path)
    with open(p, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != PLACEMENTS_FORMAT:
        raise ValueError(f"{p}: allowed: a {PLACEMENTS_FORMAT!r} version {VERSION} document")
    return {
        int(i): Placement.from_dict(d, f"{p} layer {i}")
        for i, d in zip(doc["layers"], doc["placements"])
    }


def write_sglang(path: str | os.PathLike, slots_per_layer: Sequence[np.ndarray]) -> None:
    """SGLang's ``--init-expert-location`` file from each layer's ``slots [W, n]``."""
    phys = [np.asarray(s).reshape(-1).tolist() for s in slots_per_layer]
    if len({len(r) for r in phys}) > 1:
        raise ValueError("every layer needs the same number of physical experts")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"physical_to_logical_map": phys}, f)


def read_sglang(path: str | os.PathLike, world: int) -> list[np.ndarray]:
    """Each layer's ``slots [world, n]`` from an ``--init-expert-location`` mapping file."""
    p = os.fspath(path)
    if p.endswith(".pt"):
        import torch

        doc = torch.load(p, map_location="cpu", weights_only=True)
    else:
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
    if not isinstance(doc, dict) or "physical_to_logical_map" not in doc:
        raise ValueError(f"{p}: allowed: a dict with 'physical_to_logical_map'")
    m = doc["physical_to_logical_map"]
    a = np.asarray(m.tolist() if hasattr(m, "tolist") else m, dtype=np.int64)
    if a.ndim != 2 or a.shape[1] % world:
        raise ValueError(
            f"{p}: physical_to_logical_map has shape {a.shape}; allowed: [layers, k * {world}]"
        )
    return [row.reshape(world, -1) for row in a]
