"""Many tensors copied into or out of one flat GPU buffer in one launch, planned once per layout.

Why. A ``cuda_ipc`` push copies every exported tensor into one flat buffer on the trainer's GPU and every
engine copies each one out again into its weights. At 1.5B that is 534 tensors in FP8 (each decoder linear
is a weight and its scale grid) and 338 in BF16, and each tensor cost host time on both sides on every push
(a view, a check, a share of a foreach copy): FP8's sync ran at 1.2-1.7x BF16's while moving 0.58x the bytes
(docs/performance.md, "Weight sync"). The layout is the same from push to push, so the work per tensor can be
done once: a ``CopyPlan`` keeps one row per tensor on the device (its address, its offset in the buffer, its
rows, row length and row stride, in words) and one Triton launch copies them all, each program one 64 KiB
chunk of one tensor. A push then costs the host a check that the tensors are still the planned ones
(``matches``: address, dtype, shape and strides of each) and one launch, whatever the tensor count.

What a plan covers: CUDA tensors of one device whose dims after the first are contiguous (any tensor the
trainer exports, and the engine's weights, whose FP8 scale grids have rows padded apart), copied as they are
(same dtype on both sides). ``CopyPlan.build`` returns None for anything else (CPU tensors, a cast, other
strides, no Triton) and the caller copies as before (``buckets.copy_pairs``). The copy moves 8-, 4-, 2- or
1-byte words, the largest that divides every address, row and stride of the plan, so it reads and writes
whole tensors at memory bandwidth (tests/test_weight_sync_ipc.py checks every byte on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU-only installs lack it (and have no CUDA tensors).
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    _HAVE_TRITON = False

# False: ``build`` makes no plan, so every push copies tensor by tensor (``bench/weight_sync.py --plans off``
# measures that path against the planned one in the same process).
ENABLED = True
CHUNK_BYTES = 1 << 16  # bytes per Triton program
_BLOCK = 1024  # words per loop iteration of a program
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# A plan's table has one row per tensor: its address, its offset in the buffer (words), rows, words per row and
# row stride (words); the kernel reads row ``owner * 5``.
_COLUMNS = 5

Key = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]


def key(t: Tensor) -> Key:
    """What a plan depends on: where the tensor's bytes are and how they are laid out."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _rows(t: Tensor) -> tuple[int, int, int] | None:
    """(rows, elements per row, row stride in elements) of ``t``, or None when its dims after the first are
    not contiguous."""
    if t.dim() == 0:
        return 1, 1, 1
    inner, step = math.prod(t.shape[1:]), 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != step:
            return None
        step *= size
    rows, stride0 = t.shape[0], t.stride(0)
    if rows == 1 or stride0 == inner:
        return 1, rows * inner, rows * inner  # contiguous: one row
    return rows, inner, stride0


if _HAVE_TRITON:

    @triton.jit
    def _copy_chunks(
        flat, table, owner, start, TO_FLAT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Program i: words [start, start + CHUNK) of tensor ``owner[i]`` (counted in its row-major order)
        between the tensor and its place in ``flat``, whose element type is the word."""
        i = tl.program_id(0)
        row_of_table = table + tl.load(owner + i) * 5  # _COLUMNS
        first = tl.load(start + i).to(tl.int32)
        tensor = tl.load(row_of_table).to(tl.pointer_type(flat.dtype.element_ty))
        placed = flat + tl.load(row_of_table + 1)
        rows = tl.load(row_of_table + 2).to(tl.int32)
        per_row = tl.load(row_of_table + 3).to(tl.int32)
        stride = tl.load(row_of_table + 4).to(tl.int32)
        n = rows * per_row
        for j in range(0, CHUNK, BLOCK):
            k = first + j + tl.arange(0, BLOCK)
            inside = k < n
            row = k // per_row
            at = row * stride + (k - row * per_row)
            if TO_FLAT:
                tl.store(placed + k, tl.load(tensor + at, mask=inside), mask=inside)
            else:
                tl.store(tensor + at, tl.load(placed + k, mask=inside), mask=inside)


@dataclass
class CopyPlan:
    """The copies between a flat buffer and ``keys``' tensors (see the module docstring)."""

    keys: list[Key]
    word: torch.dtype
    table: Tensor  # (tensors, _COLUMNS) int64 on the device
    owner: Tensor  # per program: its tensor's row of ``table``
    start: Tensor  # per program: its first word in that tensor
    chunk_words: int

    @staticmethod
    def build(
        tensors: Sequence[Tensor], offsets: Sequence[int], flat_dtypes: Sequence[str]
    ) -> CopyPlan | None:
        """A plan for copying ``tensors[i]`` to or from bytes ``offsets[i]`` of a flat buffer, where it lies as
        a contiguous tensor of dtype ``flat_dtypes[i]`` (a transport layout's dtype name); None where one launch
        cannot do it (module docstring)."""
        if not (ENABLED and _HAVE_TRITON) or not tensors or len({t.device for t in tensors}) != 1:
            return None
        if tensors[0].device.type != "cuda":
            return None
        rows_of: list[tuple[int, int, int]] = []
        for t, dtype_name in zip(tensors, flat_dtypes, strict=True):
            shape = _rows(t)
            if shape is None or str(t.dtype) not in (dtype_name, f"torch.{dtype_name}"):
                return None  # strides a row cannot describe, or a cast
            rows_of.append(shape)
        # Bytes of every address, offset, row and stride: the word is the largest size that divides them all.
        sizes = [t.data_ptr() for t in tensors] + list(offsets)
        for t, (_, per_row, stride) in zip(tensors, rows_of):
            sizes += [per_row * t.element_size(), stride * t.element_size()]
        word = next(w for w in _WORDS if all(s % w == 0 for s in sizes))
        table, chunks = [], []
        chunk_words = CHUNK_BYTES // word
        for t, offset, (rows, per_row, stride) in zip(tensors, offsets, rows_of):
            e = t.element_size()
            n_words = rows * per_row * e // word
            if max(n_words, rows * stride * e // word) >= 2**31:
                return None  # the kernel counts words in int32
            table.append([t.data_ptr(), offset // word, rows, per_row * e // word, stride * e // word])
            chunks.append(-(-n_words // chunk_words))
        device = tensors[0].device
        counts = torch.tensor(chunks, dtype=torch.int64)
        owner = torch.repeat_interleave(torch.arange(len(chunks)), counts)
        first_chunk = torch.cumsum(counts, 0) - counts
        start = (torch.arange(owner.numel()) - first_chunk[owner]) * chunk_words
        return CopyPlan(
            keys=[key(t) for t in tensors],
            word=_WORDS[word],
            table=torch.tensor(table, dtype=torch.int64).to(device),
            owner=owner.to(device),
            start=start.to(device),
            chunk_words=chunk_words,
        )

    def matches(self, tensors: Sequence[Tensor]) -> bool:
        """True when ``tensors`` are where, and laid out as, the ones the plan was built for."""
        return len(tensors) == len(self.keys) and all(key(t) == k for t, k in zip(tensors, self.keys))

    def run(self, flat: Tensor, to_flat: bool) -> None:
        """Copy every tensor into ``flat`` (``to_flat``) or out of it, queued on the current stream."""
        if self.owner.numel() == 0:
            return
        size = self.word.itemsize
        if flat.data_ptr() % size or flat.numel() % size:
            raise ValueError(
                f"CopyPlan: a flat buffer at {flat.data_ptr():#x} of {flat.numel()} bytes is not in {size}-byte words"
            )
        words = flat.view(self.word)
        with torch.cuda.device(flat.device):
            _copy_chunks[(self.owner.numel(),)](
                words,
                self.table,
                self.owner,
                self.start,
                TO_FLAT=to_flat,
                CHUNK=self.chunk_words,
                BLOCK=_BLOCK,
            )
