"""What every part of the CUDA transport shares: the pair codes, the compiled module, the
tensor checks and the device names. ``native``, ``_device`` and ``device_uuid`` are looked
up through the package (``pcie_a2a.transport.cuda``) by the other modules, so that the
tests and the CPU model of CUDA replace them in one place."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

P2P, STAGED, PULL = 0, 1, 2  # PULL: a P2P pair whose receiver reads the rows (pull.cuh)
_OP_DISPATCH, _OP_COMBINE, _OP_LL_DISPATCH, _OP_LL_COMBINE = 1, 2, 3, 4
_FAMILY = {_OP_DISPATCH: 0, _OP_LL_DISPATCH: 0, _OP_COMBINE: 1, _OP_LL_COMBINE: 1}


def native():
    """The compiled module (ImportError when the build has no CUDA)."""
    from pcie_a2a import _cuda_transport

    return _cuda_transport


def _ptr(t: torch.Tensor | int | None) -> int:
    if t is None:
        return 0
    if isinstance(t, int):
        return t
    return t.data_ptr()


def _check(t, name: str, device, dtypes: tuple, shape: tuple, align: int = 16) -> None:
    """Raises ValueError/TypeError naming the tensor, what it is and what is allowed
    (None in `shape`: any size; `align`: bytes, 16 for rows stored as vectors)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.device != device:
        raise ValueError(f"{name}.device: got {t.device}, expected {device}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}.dtype: got {t.dtype}, expected {want}")
    if t.dim() != len(shape) or any(w is not None and g != w for g, w in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name}.shape: got {list(t.shape)}, expected {want}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: got a non-contiguous tensor, expected a contiguous one")
    if align and t.numel() and t.data_ptr() % align:
        raise ValueError(
            f"{name}: got data at address {t.data_ptr():#x}, expected {align}-byte alignment "
            "(the kernels move rows as 16-byte vectors; .clone() gives an aligned copy)"
        )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The eager path accepts any contiguous tensor (as the CPU transport does): a view at
    an odd offset is copied to a fresh, aligned allocation."""
    return t.clone() if t.numel() and t.data_ptr() % 16 else t


def package() -> Any:
    """The ``pcie_a2a.transport.cuda`` package, looked up when called (not bound at import,
    which would make each module of the package import the package it is part of): the tests
    and the CUDA emulation replace ``native``, ``_device``, ``device_uuid``, ``cuda_bus_id``
    and ``topology_rank_transfers`` on it."""
    import pcie_a2a.transport.cuda as pkg

    return pkg


def _release(tx: Any, names: list[str]) -> None:
    """The non-collective close (garbage collection, interpreter exit, a failed bootstrap):
    closes the imports and frees this rank's memory only if every peer's close mark is
    already there; else the device segment is left to the process exit (freeing memory a
    peer still has mapped is undefined behaviour)."""
    if tx is not None:
        tx.close()
    try:
        from pcie_a2a.transport import cuda as pkg

        mod = pkg.native()
    except ImportError:  # interpreter shutdown
        return
    for name in names:
        mod.CudaTransport.unlink_name(name)


def _nonce(prefix: str) -> int:
    """The bootstrap's number every rank derives from the shared prefix: the probe pattern
    and the close mark (a fresh segment never holds it)."""
    return int.from_bytes(hashlib.blake2b(prefix.encode(), digest_size=8).digest(), "little") | 1


def _device(index: int | None) -> torch.device:
    """The torch device of a transport on CUDA device `index` (None: the current one)."""
    return torch.device("cuda", torch.cuda.current_device() if index is None else index)


def device_uuid(index: int) -> str:
    """A name of CUDA device `index` that every process agrees on, whatever its
    CUDA_VISIBLE_DEVICES: the device UUID (PCI location as a fallback)."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    pci = tuple(getattr(props, f, None) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    return f"pci:{pci}" if None not in pci else f"index:{index}"
