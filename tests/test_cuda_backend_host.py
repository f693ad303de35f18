"""Host-side logic of the CUDA backend that needs no GPU: the per-sender pair plan and the
input checks of the graph-capturable path (python/pcie_a2a/transport/cuda.py)."""

from __future__ import annotations

import pytest
import torch

from pcie_a2a.transport.cuda import P2P, STAGED, _aligned, _check, outgoing_pairs
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


def test_topology_rank_transfers_from_the_topology_file(monkeypatch):
    from pcie_a2a.transport.cuda import topology_rank_transfers

    box = FIXTURES / "8x-rtx4090-dual-xeon-broadcom-pix.topo.txt"
    monkeypatch.setenv("PCIE_A2A_TOPO_FILE", str(box))
    rp, note = topology_rank_transfers(BUS8)
    assert rp is not None and note.startswith(f"topology plan from {box}")
    assert rp.gpus == tuple(range(8)) and rp.staging_numa == (0, 0, 0, 0, 1, 1, 1, 1)
    monkeypatch.setenv("PCIE_A2A_P2P", "0")  # the planner's options come from the env
    rp, _ = topology_rank_transfers(BUS8)
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
def test_topology_rank_transfers_falls_back_saying_why(monkeypatch, bus_ids, topo_file, why):
    from pcie_a2a.transport.cuda import topology_rank_transfers

    if topo_file:
        monkeypatch.setenv("PCIE_A2A_TOPO_FILE", str(FIXTURES / topo_file))
    rp, note = topology_rank_transfers(bus_ids)
    assert rp is None and why in note, note


# ---- environment checks (pcie_a2a.cuda_checks): the verdict and the message --------------
def _report(mode: int = 0) -> dict:
    return {"compute_mode": mode, "host_register": 1, "multiprocessors": 132, "cc": (9, 0),
            "driver_version": 13000, "runtime_version": 13000}  # fmt: skip


def test_exclusive_process_mode_with_ranks_sharing_a_gpu_is_an_error():
    from pcie_a2a.cuda_checks import environment_problems

    errors, _ = environment_problems([A, A], [_report(3), _report(3)], None)
    assert len(errors) == 1 and "ranks [0, 1] share GPU GPU-a" in errors[0]
    assert "EXCLUSIVE_PROCESS" in errors[0] and "nvidia-smi -i N -c DEFAULT" in errors[0]
    # one rank per GPU, or MPS: allowed (MPS is said)
    assert environment_problems([A, B], [_report(3), _report(3)], None) == ([], [])
    errors, warns = environment_problems([A, A], [_report(3), _report(3)], "/tmp/nvidia-mps")
    assert errors == [] and "MPS is running (pipe directory /tmp/nvidia-mps)" in warns[0]
    errors, _ = environment_problems([A], [_report(2)], None)
    assert "PROHIBITED" in errors[0]


def test_mps_is_found_by_its_control_pipe(tmp_path):
    from pcie_a2a.cuda_checks import mps_running

    assert mps_running(str(tmp_path)) is None
    (tmp_path / "control").write_text("")
    assert mps_running(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize(
    ("driver", "runtime", "want"),
    [
        (13000, 13000, ""),
        (13010, 13000, ""),
        (12080, 12080, ""),
        (12020, 12080, ""),  # minor version compatibility: any 12.x driver (R525+)
        (12090, 13000, "needs driver R580 or newer"),
        (0, 13000, "no NVIDIA driver was found"),
    ],
)
def test_driver_floor(driver, runtime, want):
    from pcie_a2a.cuda_checks import driver_floor_problem

    got = driver_floor_problem(driver, runtime)
    assert (want in got) if want else got == "", got
    if "R580" in want:
        assert "CUDA 12.9" in got and "PCIE_A2A_CUDA_TOOLKIT" in got and "R525" in got


def test_cuda_errors_get_a_remedy():
    from pcie_a2a.cuda_checks import explain_cuda_error

    assert "EXCLUSIVE_PROCESS" in explain_cuda_error("cudaErrorDevicesUnavailable: busy")
    assert "cuda_unavailable_reason" in explain_cuda_error("x cudaErrorInsufficientDriver y")
    assert explain_cuda_error("cudaErrorMemoryAllocation") == "cudaErrorMemoryAllocation"


def test_probe_failure_names_the_pair_the_causes_and_the_switch():
    from pcie_a2a.cuda_checks import probe_failures

    plan = [[P2P, P2P, STAGED], [P2P, P2P, P2P], [P2P, P2P, P2P]]
    bus = ["0000:01:00.0", "0000:41:00.0", None]
    assert probe_failures([[0, 0, 0]] * 3, plan, bus, 5.0) == ""
    msg = probe_failures([[0, 1, 0], [0, 0, 0], [2, 0, 0]], plan, bus, 5.0)
    assert "rank 1 -> rank 0 (P2P over CUDA IPC, GPU 0000:41:00.0 -> GPU 0000:01:00.0): " \
           "nothing arrived within 5 s" in msg  # fmt: skip
    assert "rank 0 -> rank 2 (staged through host memory, GPU 0000:01:00.0 -> GPU ?): the " \
           "bytes that arrived were wrong" in msg  # fmt: skip
    for cause in ("IOMMU", "ACS", "BAR1", "PCIE_A2A_P2P=0"):
        assert cause in msg


def test_plan_on_rank0_turns_any_exception_into_the_gathered_error(monkeypatch):
    from pcie_a2a.transport import cuda as cuda_backend

    def boom(bus_ids):
        raise KeyError("GPU 0000:99:00.0")

    monkeypatch.setattr(cuda_backend, "topology_rank_transfers", boom)
    assert cuda_backend.plan_on_rank0(False, BUS8) == (None, "", "KeyError: 'GPU 0000:99:00.0'")
    assert cuda_backend.plan_on_rank0(True, BUS8) == (None, "explicit plan", None)


@pytest.mark.parametrize(
    ("name", "value", "fn", "want"),
    [
        ("PCIE_A2A_RECV_BLOCKS", None, "recv_blocks", None),
        ("PCIE_A2A_RECV_BLOCKS", "24", "recv_blocks", 24),
        ("PCIE_A2A_PDL", None, "pdl", True),
        ("PCIE_A2A_PDL", "0", "pdl", False),
    ],
)
def test_transport_knobs(monkeypatch, name, value, fn, want):
    from pcie_a2a import env

    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert getattr(env, fn)() == want


def test_recv_blocks_rejects_zero(monkeypatch):
    from pcie_a2a import env

    monkeypatch.setenv("PCIE_A2A_RECV_BLOCKS", "0")
    with pytest.raises(ValueError, match=r"PCIE_A2A_RECV_BLOCKS='0': expected an integer >= 1"):
        env.recv_blocks()


# ---- bootstrap failures reach every rank (no rank waits for the process-group timeout) ----
class _StubNative:
    """What the bootstrap asks the native module before it builds regions."""

    class CudaTransport:
        @staticmethod
        def segment_name(prefix, rank):
            return f"/{prefix}.h{rank}"

        @staticmethod
        def unlink_name(name):
            return False

    report = staticmethod(lambda index: _report())


def _rank_bootstrap_fails(rank: int, world: int, where: str) -> str:
    import time

    from pcie_a2a.placement import Placement
    from pcie_a2a.transport import cuda as cuda_backend

    stub = _StubNative()
    stub.device_report = _StubNative.report
    if where == "device" and rank == 1:

        def broken(index):
            raise RuntimeError("cudaDeviceGetAttribute failed: cudaErrorDevicesUnavailable")

        stub.device_report = broken
    if where == "exclusive":
        stub.device_report = lambda index: _report(3)
    cuda_backend.native = lambda: stub
    cuda_backend._device = lambda index: torch.device("cpu")
    cuda_backend.device_uuid = lambda index: "GPU-shared" if where == "exclusive" else f"GPU-{rank}"
    cuda_backend.cuda_bus_id = lambda index: f"0000:{rank + 1:02x}:00.0"

    def planner_bug(bus_ids):
        raise KeyError("rank plan lookup")

    cuda_backend.topology_rank_transfers = planner_bug
    t0 = time.monotonic()
    try:
        cuda_backend.CudaTransport(
            None, rank, world, 128, 4, 2, 0, 0, Placement.contiguous(4, world)
        )
    except RuntimeError as exc:
        assert time.monotonic() - t0 < 30, "a rank waited for the process group's timeout"
        return str(exc)
    raise AssertionError("the bootstrap did not fail")


@pytest.mark.parametrize(
    ("where", "want"),
    [
        ("planner", "while rank 0 planned the pairs: KeyError: 'rank plan lookup'"),
        ("device", "while querying the devices: rank 1: cudaDeviceGetAttribute failed"),
        ("exclusive", "ranks [0, 1] share GPU GPU-shared, which is in EXCLUSIVE_PROCESS"),
    ],
)
def test_bootstrap_failure_reaches_every_rank(where, want):
    """Rank 0's planner raising something unexpected, one rank's device query failing, or
    the compute mode: every rank raises the same error, at once."""
    from dist_utils import run_ranks

    msgs = [o.unwrap() for o in run_ranks(2, _rank_bootstrap_fails, where, timeout=90)]
    for m in msgs:
        assert want in m, m
    if where == "device":
        assert "EXCLUSIVE_PROCESS or PROHIBITED compute mode" in msgs[0]


# ---- backend="auto": one verdict for the whole group ----------------------------------------
def _votes(monkeypatch, per_rank: list[bool], forced: list[str | None] | None = None):
    """choose_backend as every rank of a group would run it: rank r's vote with its CUDA
    availability and PCIE_A2A_BACKEND, gathered."""
    from pcie_a2a import _native
    from pcie_a2a.transport import _vote

    votes = []
    for r, ok in enumerate(per_rank):
        monkeypatch.setattr(_native, "cuda_available", lambda ok=ok: ok)
        monkeypatch.setattr(_native, "cuda_unavailable_reason", lambda r=r: f"no GPU on rank {r}")
        if forced and forced[r]:
            monkeypatch.setenv("PCIE_A2A_BACKEND", forced[r])
        else:
            monkeypatch.delenv("PCIE_A2A_BACKEND", raising=False)
        votes.append(_vote("auto"))
    return lambda mine: votes


def test_auto_is_cuda_only_when_every_rank_can_run_it(monkeypatch):
    from pcie_a2a.transport import choose_backend

    assert choose_backend("auto", _votes(monkeypatch, [True, True])) == "cuda"
    assert choose_backend("auto", _votes(monkeypatch, [False, False])) == "cpu"
    assert choose_backend("auto", _votes(monkeypatch, [True, True], ["cpu", "cpu"])) == "cpu"
    with pytest.raises(RuntimeError) as info:
        choose_backend("auto", _votes(monkeypatch, [True, False, True]))
    msg = str(info.value)
    assert "ranks [1] of 3 cannot run the CUDA transport (rank 1: no GPU on rank 1)" in msg
    assert "PCIE_A2A_BACKEND=cpu on every rank" in msg
    with pytest.raises(
        ValueError, match=r"PCIE_A2A_BACKEND differs between ranks: \['cpu', None\]"
    ):
        choose_backend("auto", _votes(monkeypatch, [True, True], ["cpu", None]))
    with pytest.raises(ValueError, match=r"backend='cuda' is not available on every rank"):
        votes = _votes(monkeypatch, [True, False])(None)
        choose_backend("cuda", lambda mine: [("cuda", *v[1:]) for v in votes])


def test_a_bad_backend_knob_reaches_every_rank(monkeypatch):
    from pcie_a2a.transport import _vote, choose_backend

    monkeypatch.setenv("PCIE_A2A_BACKEND", "tpu")
    bad = _vote("auto")
    monkeypatch.delenv("PCIE_A2A_BACKEND")
    good = _vote("auto")
    with pytest.raises(ValueError, match=r"rank 1: PCIE_A2A_BACKEND='tpu'"):
        choose_backend("auto", lambda mine: [good, bad])


# ---- rank 0's plan is kept per process -----------------------------------------------------
def test_topology_plan_is_discovered_once_per_process(monkeypatch):
    from pcie_a2a.topology import sources
    from pcie_a2a.transport import cuda as cuda_backend

    calls = []

    def discover():
        calls.append(1)
        raise OSError("no sysfs here")

    monkeypatch.setattr(sources, "current_with_probe", discover)
    cuda_backend.clear_plan_cache()
    try:
        first = cuda_backend.topology_rank_transfers(BUS8)
        assert first[0] is None and "no sysfs here" in first[1]
        assert cuda_backend.topology_rank_transfers(BUS8) == first and len(calls) == 1
        monkeypatch.setenv("PCIE_A2A_P2P", "0")  # a knob of the plan: planned again
        cuda_backend.topology_rank_transfers(BUS8)
        assert len(calls) == 2
    finally:
        cuda_backend.clear_plan_cache()
