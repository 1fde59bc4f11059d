"""Digests of tensors for the weight-sync self-check, computed where the tensors live.

The self-check compares what an engine holds with what the trainer sent. Reading both back to the driver
moved two decoder layers (~94 MB at 1.5B in FP8) through Ray twice per push: 0.42 s of a ~0.8 s weight-sync
phase on an H100 (docs/performance.md). Each side now reduces its tensors on its own device to a
``Digest``: dtype, shape and three integer sums over the tensor's bytes, one plain and two weighted by
position (period 251 bytes, and 251-byte blocks with period 65,521), and only those few numbers travel.

What it catches: any change of dtype or shape; any change of a single byte (the plain sum); two bytes
swapped (a weighted sum), unless they are a multiple of 251 x 65,521 bytes apart *and* at the same offset
mod 251; a tensor filled, zeroed or loaded from another tensor of the same shape (all three sums). It is a
check against faults (verl#7986: FP8 layers silently wrong after a reload), not against an adversary. The
sums are exact integers (int64, at most 255 x 65,521 per byte: no overflow below 2 GiB per tensor), so the
CPU and every GPU give the same digest for the same bytes.

How they are computed. On the CPU, per tensor with a few torch reductions (``_sums``). On a CUDA GPU, for all
tensors of that GPU in one Triton launch (``_sums_triton``): each program sums one 64 KiB chunk of one tensor,
read through a table of the tensors' addresses, and the chunks' partial sums are added per tensor (integer
adds: exact in any order, the same numbers as ``_sums``; tests/test_weight_sync_digest.py compares the two
on the GPU). Per tensor the torch reductions were ~20 launches and ~0.3 ms of host time in a Ray actor: the
FP8 self-check's ~38 tensors took 11-12 ms per side on an H200 (``bench/weight_sync.py --phases``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU-only installs lack it (and have no CUDA tensors).
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    _HAVE_TRITON = False

_P1, _P2 = 251, 65521
MAX_BYTES = 1 << 31
_CHUNK = 1 << 16  # bytes per Triton program
_BLOCK = 1024  # bytes per loop iteration of a program


class Digest(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    sums: tuple[int, int, int]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sums(t: Tensor) -> Tensor:
    """The three sums of ``t``'s bytes as an int64 tensor (3,) on t's device, not yet read back."""
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n >= MAX_BYTES:
        raise ValueError(f"digest: {n} bytes; the int64 sums are exact only below {MAX_BYTES}")
    # Byte i sits at row i // 251, column i % 251 of a (rows, 251) view: the column sums give the sum weighted
    # by (i % 251) + 1, the row sums the one weighted by (i // 251) % 65521 + 1, and the plain sum; two
    # reductions over the bytes, no int64 copy of them. The last, partial row is summed on its own.
    full = (n // _P1) * _P1
    dev = flat.device
    rows = flat[:full].view(-1, _P1)
    col_sums = rows.sum(0, dtype=torch.int64)
    row_sums = rows.sum(1, dtype=torch.int64)
    tail = flat[full:].to(torch.int64)
    col_sums[: tail.numel()] += tail
    row_sums = torch.cat([row_sums, tail.sum().view(1)])
    w_col = torch.arange(1, _P1 + 1, device=dev, dtype=torch.int64)
    w_row = torch.arange(row_sums.numel(), device=dev, dtype=torch.int64) % _P2 + 1
    return torch.stack([row_sums.sum(), (col_sums * w_col).sum(), (row_sums * w_row).sum()])


if _HAVE_TRITON:

    @triton.jit
    def _digest_chunks(
        ptrs, sizes, chunk_tensor, chunk_start, partials, CHUNK: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Program i: the three sums of bytes [start, start + CHUNK) of tensor ``chunk_tensor[i]`` into
        ``partials[i, 0:3]`` (weights as in ``_sums``: 1, i % 251 + 1, (i // 251) % 65521 + 1)."""
        i = tl.program_id(0)
        t = tl.load(chunk_tensor + i)
        start = tl.load(chunk_start + i)
        n = tl.load(sizes + t)
        base = tl.load(ptrs + t).to(tl.pointer_type(tl.uint8))
        s0 = tl.zeros((BLOCK,), tl.int64)
        s1 = tl.zeros((BLOCK,), tl.int64)
        s2 = tl.zeros((BLOCK,), tl.int64)
        for j in range(0, CHUNK, BLOCK):
            offs = start + j + tl.arange(0, BLOCK).to(tl.int64)
            b = tl.load(base + offs, mask=offs < n, other=0).to(tl.int64)
            s0 += b
            s1 += b * (offs % 251 + 1)
            s2 += b * ((offs // 251) % 65521 + 1)
        tl.store(partials + i * 3, tl.sum(s0, 0))
        tl.store(partials + i * 3 + 1, tl.sum(s1, 0))
        tl.store(partials + i * 3 + 2, tl.sum(s2, 0))


def _sums_triton(tensors: list[Tensor]) -> Tensor:
    """``torch.stack([_sums(t) for t in tensors])`` for contiguous tensors of one CUDA device, in one launch."""
    device = tensors[0].device
    sizes = [t.numel() * t.element_size() for t in tensors]
    if max(sizes) >= MAX_BYTES:
        raise ValueError(f"digest: {max(sizes)} bytes; the int64 sums are exact only below {MAX_BYTES}")
    owner: list[int] = []
    starts: list[int] = []
    for k, n in enumerate(sizes):
        chunks = -(-n // _CHUNK)
        owner += [k] * chunks
        starts += range(0, chunks * _CHUNK, _CHUNK)
    out = torch.zeros(len(tensors), 3, dtype=torch.int64, device=device)
    if not owner:  # every tensor empty
        return out
    # One host-to-device copy of the tables: addresses, sizes, then each chunk's tensor and start.
    table = torch.tensor([t.data_ptr() for t in tensors] + sizes + owner + starts, dtype=torch.int64).to(
        device
    )
    k, c = len(tensors), len(owner)
    ptrs, size_t, owner_t, start_t = table[:k], table[k : 2 * k], table[2 * k : 2 * k + c], table[2 * k + c :]
    partials = torch.empty(c, 3, dtype=torch.int64, device=device)
    with torch.cuda.device(device):
        _digest_chunks[(c,)](ptrs, size_t, owner_t, start_t, partials, CHUNK=_CHUNK, BLOCK=_BLOCK)
    return out.index_add_(0, owner_t, partials)


def _as(t: Tensor, as_dtype: str | None) -> Tensor:
    t = t.detach()
    if as_dtype is not None and dtype_name(t.dtype) != as_dtype:
        t = t.to(getattr(torch, as_dtype))
    return t


def digest(t: Tensor, as_dtype: str | None = None) -> Digest:
    """The digest of ``t``'s bytes (cast to ``as_dtype`` first when given and different: the self-check
    compares a tensor an engine keeps in another dtype with the sent one cast the same way)."""
    t = _as(t, as_dtype)
    s0, s1, s2 = (int(v) for v in _sums(t).tolist())
    return Digest(dtype_name(t.dtype), tuple(t.shape), (s0, s1, s2))


def digests(
    named: dict[str, Tensor], names: list[str], as_dtypes: dict[str, str] | None = None
) -> dict[str, Digest]:
    """Digests of ``named[name]`` for each name (``as_dtypes[name]``: the dtype to cast to first, if any);
    a name that is not there raises ``KeyError`` naming it. The sums of all tensors on one device are read
    back together: one device-to-host wait per device instead of one per tensor (the FP8 self-check digests
    ~38 tensors per side per push), and on a GPU computed in one launch (module docstring)."""
    tensors = {name: _as(named[name], (as_dtypes or {}).get(name)) for name in names}
    by_device: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        by_device.setdefault(t.device, []).append(name)
    out: dict[str, Digest] = {}
    for device, group in by_device.items():
        if device.type == "cuda" and _HAVE_TRITON:
            sums = _sums_triton([tensors[name].contiguous() for name in group]).tolist()
        else:
            sums = torch.stack([_sums(tensors[name]) for name in group]).tolist()
        for name, (s0, s1, s2) in zip(group, sums, strict=True):
            t = tensors[name]
            out[name] = Digest(dtype_name(t.dtype), tuple(t.shape), (int(s0), int(s1), int(s2)))
    return {name: out[name] for name in names}
