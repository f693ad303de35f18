"""Host-side logic of the CUDA backend that needs no GPU: the per-sender pair plan and the
input checks of the graph-capturable path (python/pcie_a2a/cuda_backend.py)."""

from __future__ import annotations

import pytest
import torch

from pcie_a2a.cuda_backend import P2P, STAGED, _aligned, _check, outgoing_pairs
from topology_fixtures import FIXTURES

A, B, C = "GPU-a", "GPU-b", "GPU-c"


def _peer_ok(pairs: set[tuple[int, int]]):
    return lambda i, j: (i, j) in pairs


# (name, rank, uuids, p2p, visible, peer-access pairs by local index, expected row)
PLAN_CASES = [
    ("one device: IPC", 0, [A, A], None, [A], set(), [P2P, P2P]),
    ("one device, P2P forced off", 1, [A, A], False, [A], set(), [STAGED, P2P]),
    ("peer access reported", 0, [A, B], None, [A, B], {(0, 1)}, [P2P, P2P]),
    ("no peer access (4090)", 0, [A, B], None, [A, B], set(), [P2P, STAGED]),
    ("asymmetric access, sender 1", 1, [A, B], None, [A, B], {(0, 1)}, [STAGED, P2P]),
    ("one GPU per process", 0, [A, B, C], None, [A], set(), [P2P, STAGED, STAGED]),
    ("forced on", 2, [A, B, C], True, [C], set(), [P2P, P2P, P2P]),
    ("forced off", 0, [A, B, A], False, [A, B], {(0, 1)}, [P2P, STAGED, STAGED]),
    ("local order differs", 1, [A, B, C], None, [C, B, A], {(1, 2)}, [P2P, P2P, STAGED]),
]


@pytest.mark.parametrize(
    ("rank", "uuids", "p2p", "visible", "pairs", "want"),
    [c[1:] for c in PLAN_CASES],
    ids=[c[0] for c in PLAN_CASES],
)
def test_outgoing_pairs(rank, uuids, p2p, visible, pairs, want):
    assert outgoing_pairs(rank, uuids, p2p, visible, _peer_ok(pairs)) == want


CPU = torch.device("cpu")
X = torch.zeros(4, 64, dtype=torch.bfloat16)
CHECK_CASES = [
    ("not a tensor", [1, 2], (torch.bfloat16,), (None, 64), TypeError, r"x: got list"),
    ("dtype", X.float(), (torch.bfloat16,), (None, 64), TypeError, r"x\.dtype: got torch\.float32"),
    ("rank", X[0], (torch.bfloat16,), (None, 64), ValueError, r"x\.shape: got \[64\], expected \[\*, 64\]"),
    ("hidden", X[:, :32], (torch.bfloat16,), (None, 64), ValueError, r"x\.shape: got \[4, 32\]"),
    ("strided", X.t(), (torch.bfloat16,), (None, 4), ValueError, r"non-contiguous"),
    ("misaligned", torch.zeros(300, dtype=torch.bfloat16)[1:257].view(4, 64), (torch.bfloat16,), (None, 64), ValueError,
     r"x: got data at address 0x[0-9a-f]+, expected 16-byte alignment"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("t", "dtypes", "shape", "exc", "msg"),
    [c[1:] for c in CHECK_CASES],
    ids=[c[0] for c in CHECK_CASES],
)
def test_check_names_the_argument(t, dtypes, shape, exc, msg):
    with pytest.raises(exc, match=msg):
        _check(t, "x", CPU, dtypes, shape)


def test_check_accepts_good_input_and_scalar_alignment():
    _check(X, "x", CPU, (torch.bfloat16,), (None, 64))
    ids = torch.zeros(9, dtype=torch.int32)[1:].view(4, 2)  # 4-byte aligned view
    _check(ids, "topk_ids", CPU, (torch.int32,), (4, None), align=4)
    with pytest.raises(ValueError, match="topk_ids: got data at address"):
        _check(ids, "topk_ids", CPU, (torch.int32,), (4, None))
    with pytest.raises(ValueError, match=r"x\.device: got cpu, expected cuda:0"):
        _check(X, "x", torch.device("cuda", 0), (torch.bfloat16,), (None, 64))


def test_aligned_copies_only_misaligned_views():
    assert _aligned(X) is X
    base = torch.arange(300, dtype=torch.float32).to(torch.bfloat16)
    view = base[1:257].view(4, 64)
    assert view.data_ptr() % 16
    fixed = _aligned(view)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, view)


BUS8 = [f"0000:{b:02x}:00.0" for b in (0x01, 0x21, 0x41, 0x61, 0x81, 0xA1, 0xC1, 0xE1)]


def test_topology_rank_plan_from_the_topology_file(monkeypatch):
    from pcie_a2a.cuda_backend import topology_rank_plan

    box = FIXTURES / "8x-rtx4090-dual-xeon-broadcom-pix.topo.txt"
    monkeypatch.setenv("PCIE_A2A_TOPO_FILE", str(box))
    rp, note = topology_rank_plan(BUS8)
    assert rp is not None and note.startswith(f"topology plan from {box}")
    assert rp.gpus == tuple(range(8)) and rp.staging_numa == (0, 0, 0, 0, 1, 1, 1, 1)
    monkeypatch.setenv("PCIE_A2A_P2P", "0")  # the planner's options come from the env
    rp, _ = topology_rank_plan(BUS8)
    assert {rp.pair_transport[s][d] for s in range(8) for d in range(8) if s != d} == {"staged"}


@pytest.mark.parametrize(
    ("bus_ids", "topo_file", "why"),
    [
        ([BUS8[0], None], None, "does not report the devices' PCI addresses"),
        (BUS8[:2], "8x-rtx4090-dual-xeon-broadcom-pix.topo.txt", "cannot tell which GPU"),
        (BUS8, "README.md", "not a topology file"),
        (BUS8, "no-such-file.txt", "No such file"),
    ],
)
def test_topology_rank_plan_falls_back_saying_why(monkeypatch, bus_ids, topo_file, why):
    from pcie_a2a.cuda_backend import topology_rank_plan

    if topo_file:
        monkeypatch.setenv("PCIE_A2A_TOPO_FILE", str(FIXTURES / topo_file))
    rp, note = topology_rank_plan(bus_ids)
    assert rp is None and why in note, note
