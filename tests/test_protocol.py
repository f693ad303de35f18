"""The transport's invariants, driven directly in one process (two ranks' transports
attached to each other), plus the segment lifecycle rules."""

from __future__ import annotations

import importlib
import os
import stat
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from pcie_a2a import _native

W, H, M, K = 2, 64, 4, 2
OP_DISPATCH = 1


def _pair():
    t = _native.transport()
    prefix = f"pcie_a2a.{os.getpid()}_{uuid.uuid4().hex[:8]}"
    ranks = [t.ShmTransport(prefix, r, W, H, M, K, 0, 0) for r in range(W)]
    for r in ranks:
        r.attach_peers()
    return t, prefix, ranks


def _send(t, sender, seq, parity, value):
    x = torch.full((1, H), value, dtype=torch.bfloat16)
    ids = torch.tensor([[1, -1]], dtype=torch.int32)  # expert 1 lives on rank 1
    w = torch.ones(1, 2)
    placement = t.Placement([0, 1, 2], [0, 1], [0, 0], W)
    send_token = torch.empty(W * M, dtype=torch.int32)
    send_count = torch.empty(W, dtype=torch.int32)
    sender.dispatch_send(
        seq,
        OP_DISPATCH,
        parity,
        x.data_ptr(),
        1,
        ids.data_ptr(),
        w.data_ptr(),
        2,
        placement,
        send_token.data_ptr(),
        send_count.data_ptr(),
    )


def _received(receiver, parity, counts):
    c = torch.tensor(counts, dtype=torch.int32)
    base = torch.tensor([0, 1], dtype=torch.int64)
    x = torch.empty(2, H, dtype=torch.bfloat16)
    i32 = [torch.empty(2, dtype=torch.int32) for _ in range(2)]
    ids, ws = torch.empty(2, K, dtype=torch.int32), torch.empty(2, K)
    per_expert = torch.zeros(1, dtype=torch.int32)
    receiver.unpack_rows(
        parity,
        c.data_ptr(),
        base.data_ptr(),
        x.data_ptr(),
        0,
        0,
        i32[0].data_ptr(),
        i32[1].data_ptr(),
        ids.data_ptr(),
        ws.data_ptr(),
        1,
        per_expert.data_ptr(),
    )
    return float(x[0, 0])  # the row from rank 0


@pytest.mark.parametrize("respect_parity", [True, False])
def test_reuse_invariant_breaks_without_parity(respect_parity):
    """Rank 0 runs two dispatches ahead of rank 1's read (what the invariant forbids for
    real ranks). With the parity rule call 3 lands in the other half and call 1's rows
    survive; forcing one parity shows the receiver reading call 3's rows as call 1's:
    exactly the corruption the two parities exist to prevent."""
    t, _, (r0, r1) = _pair()
    try:
        _send(t, r0, seq=1, parity=1, value=1.0)
        _send(t, r0, seq=3, parity=0 if respect_parity else 1, value=3.0)
        # rank 1 sends nothing to itself; rank 0 sent one row in each call
        got = _received(r1, parity=1, counts=[1, 0])
        assert got == (1.0 if respect_parity else 3.0)
    finally:
        r0.close()
        r1.close()


def test_flags_carry_the_call_number_and_are_never_reset():
    # Load every native module first: none may change how another's errors surface.
    for name in ("_numa", "_cuda", "_cuda_transport", "_moe_int4"):
        try:
            importlib.import_module(f"pcie_a2a.{name}")
        except ImportError:
            pass  # not in a CPU-only build
    t, _, (r0, r1) = _pair()
    try:
        _send(t, r0, seq=5, parity=1, value=1.0)
        _send(t, r1, seq=5, parity=1, value=1.0)
        assert r1.wait(5, OP_DISPATCH, 1.0) == [1, 1]  # one row from each rank
        # a stale flag (call 5) never satisfies a wait for call 7 of the same parity
        with pytest.raises(_native.transport().PeerTimeoutError, match="call 7"):
            r1.wait(7, OP_DISPATCH, 0.2)
    finally:
        r0.close()
        r1.close()


def test_segments_are_private_and_removed():
    t = _native.transport()
    prefix = f"pcie_a2a.{os.getpid()}_{uuid.uuid4().hex[:8]}"
    tr = t.ShmTransport(prefix, 0, 1, H, M, K, 0, 0)
    path = "/dev/shm" + t.ShmTransport.segment_name(prefix, 0)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    tr.close()
    assert not os.path.exists(path)
    tr.close()  # twice is fine
    tr2 = t.ShmTransport(prefix, 0, 1, H, M, K, 0, 0)
    del tr2  # garbage collection removes the name too
    assert not os.path.exists(path)


def test_buffer_names_are_gone_after_bootstrap_even_if_the_process_is_killed(tmp_path):
    """After bootstrap every rank has unlinked its name, so a SIGKILL leaves nothing."""
    script = tmp_path / "victim.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch.distributed as dist
        from dist_utils import free_port
        import pcie_a2a
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}",
                                rank=0, world_size=1)
        buf = pcie_a2a.Buffer(None, 8, 128, 4)
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == -9, proc.stderr
    pid = proc.stdout.strip()
    assert pid and not [n for n in os.listdir("/dev/shm") if n.startswith(f"pcie_a2a.{pid}_")]


def test_buffer_close_twice_and_use_after_close(single_rank_group):
    import pcie_a2a

    buf = pcie_a2a.Buffer(None, 8, 128, 4)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3]])
    res = buf.dispatch(x, ids, torch.ones(2, 2))
    assert res.x.shape == (2, 128)
    buf.close()
    buf.close()
    with pytest.raises(RuntimeError, match="closed"):
        buf.dispatch(x, ids, torch.ones(2, 2))
    with pcie_a2a.Buffer(None, 8, 128, 4) as other:
        with pytest.raises(ValueError, match="another Buffer"):
            other.combine(res.x, res.handle)


def test_handle_of_a_freed_buffer_is_refused_by_one_at_the_same_address(single_rank_group):
    """Handles used to carry id(buffer): a Buffer created after another was freed often
    gets the same id(), accepted the old handle and indexed its tensors with its own
    max_tokens (a heap read past their end under AddressSanitizer with two ranks)."""
    import pcie_a2a

    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3]])
    reused = 0
    for _ in range(20):
        old = pcie_a2a.Buffer(None, 8, 128, 4)
        res = old.dispatch(x, ids, torch.ones(2, 2))
        old_id = id(old)
        old.close()
        del old  # freed: CPython hands its address to the next Buffer most of the time
        with pcie_a2a.Buffer(None, 8, 128, 64) as new:
            reused += id(new) == old_id
            with pytest.raises(ValueError, match="another Buffer"):
                new.combine(res.x, res.handle)
        if reused:
            break


@pytest.mark.parametrize(
    "offset, rank, local, fragment",
    [
        ([0, 1], [5], [0], "placement replica 0 is out of range"),  # rank 5 of 2
        ([0, 1], [0], [-1], "placement replica 0 is out of range"),
        ([0, 0, 1], [0], [0], "expert 0 has no replica"),
        ([0, 2], [0], [0], "placement CSR arrays are inconsistent"),
    ],
)
def test_native_placement_table_is_validated(offset, rank, local, fragment):
    """A bad table would index past the peer list: refused before any call."""
    with pytest.raises(ValueError, match=fragment):
        _native.transport().Placement(offset, rank, local, W)


def test_timeout_default_comes_from_the_environment(single_rank_group, monkeypatch):
    import pcie_a2a

    monkeypatch.setenv("PCIE_A2A_TIMEOUT_S", "2.5")
    with pcie_a2a.Buffer(None, 8, 128, 4) as buf:
        assert buf.timeout_s == 2.5
    with pcie_a2a.Buffer(None, 8, 128, 4, timeout_s=7) as buf:
        assert buf.timeout_s == 7.0  # an explicit argument wins
    monkeypatch.setenv("PCIE_A2A_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PCIE_A2A_TIMEOUT_S='soon'"):
        pcie_a2a.Buffer(None, 8, 128, 4)
