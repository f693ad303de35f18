"""Buffer.memory_bytes() and pcie_a2a.buffer_memory against what the transports really
allocate (the native segment sizes), and the Kimi K2.6 budget. The CUDA transport's
segments are checked in the CUDA execution model (test_cuda_backend_emulated.py::
test_self_test_passes_and_names_the_broken_pair compares them too)."""

from __future__ import annotations

import pytest

from pcie_a2a.buffer_memory import (
    combine_slot_bytes,
    dispatch_slot_bytes,
    segment_bytes,
    transport_memory,
)

GiB = 1 << 30


@pytest.mark.parametrize(
    ("hidden", "max_tokens", "topk", "payload", "pull"),
    [(256, 12, 4, "bf16", False), (1024, 7, 8, "fp8", False), (384, 33, 6, "bf16", True),
     (512, 5, 1, "fp8", True)],
)  # fmt: skip
def test_cpu_formula_is_the_segment_the_cpu_transport_allocates(
    single_rank_group, hidden, max_tokens, topk, payload, pull
):
    import torch

    import pcie_a2a

    dtype = torch.bfloat16
    # world 1 cannot pull (a rank never pulls from itself): the pull layout is checked by
    # the formula against the CUDA model's segments; here it is off
    del pull
    with pcie_a2a.Buffer(None, 8, hidden, max_tokens, dtype=dtype, payload=payload,
                         num_topk=topk, backend="cpu") as buf:  # fmt: skip
        tx = buf._transport._tx
        got = buf.memory_bytes()
        assert tx.dispatch_slot_bytes == dispatch_slot_bytes(hidden, topk, payload)
        assert tx.combine_slot_bytes == combine_slot_bytes(hidden)
        assert got == {"backend": "cpu", "device": 0, "host": tx.segment_bytes,
                       "segment": tx.segment_bytes, "host_staging": 0,
                       "copy_engine_pack": 0}, got  # fmt: skip


def _rank_pull(rank: int, world: int) -> tuple[int, int]:
    import pcie_a2a

    direction = [["push", "pull"], ["pull", "push"]]
    with pcie_a2a.Buffer(None, 4, 256, 9, num_topk=2, backend="cpu",
                         pair_direction=direction) as buf:  # fmt: skip
        return buf.memory_bytes()["segment"], buf._transport._tx.segment_bytes


def test_cpu_formula_with_pulled_pairs():
    from dist_utils import run_ranks

    for got, real in (o.unwrap() for o in run_ranks(2, _rank_pull, timeout=120)):
        assert got == real
        assert real > segment_bytes(2, 256, 9, 2, "bf16")  # the pull send slots are there


def test_kimi_k26_fits_in_2_gib_per_gpu():
    """hidden 7168, 384 experts, top-8, 8 ranks: the decode Buffer (256 tokens per rank,
    low latency) and the prefill Buffer (8192-token chunks moved in pieces through a
    1024-token region: Buffer(max_tokens_per_rank=1024, max_dispatch_tokens=8192)), every
    pair pulled (the largest layout) and host-staged peers (pinned host, not device)."""
    kw = dict(with_pull=True, host_staged_peers=True)
    decode = transport_memory("cuda", 8, 7168, 256, 8, "bf16", **kw)
    prefill = transport_memory("cuda", 8, 7168, 1024, 8, "bf16", **kw)
    total = decode.device_bytes + prefill.device_bytes
    assert total <= 2 * GiB, total / GiB
    # without pieces the prefill Buffer alone would not fit
    whole = transport_memory("cuda", 8, 7168, 8192, 8, "bf16", **kw)
    assert whole.device_bytes > 2 * GiB
    # the formula's dispatch row at these shapes, by hand: 16 header + 32 ids + 32 weights
    # + 2 * 7168 payload
    assert dispatch_slot_bytes(7168, 8, "bf16") == 16 + 32 + 32 + 14336


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"backend: got 'tpu'"):
        transport_memory("tpu", 2, 128, 4, 2)
    with pytest.raises(ValueError, match=r"payload: got 'int4'"):
        transport_memory("cpu", 2, 128, 4, 2, "int4")
