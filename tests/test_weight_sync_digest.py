"""The weight-sync self-check's digest (``weight_sync/digest.py``): equal bytes give equal digests on any
device and chunking; a flipped bit, two swapped elements, another shape, dtype or tensor do not. And the
service's self-check, now comparing digests, still names a corrupted tensor (tests/test_weight_sync_service.py)."""

from __future__ import annotations

import pytest
import torch

from infir2_rl.weight_sync import digest as D


def _fp8(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)


def _by_definition(t: torch.Tensor) -> tuple[int, int, int]:
    b = t.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    i = torch.arange(b.numel(), dtype=torch.int64)
    return int(b.sum()), int((b * (i % 251 + 1)).sum()), int((b * ((i // 251) % 65521 + 1)).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_the_digest_is_its_definition_and_equal_bytes_give_equal_digests(dtype: torch.dtype) -> None:
    for n in (0, 1, 62, 63, 64, 65, 300 * 77):  # around the 251-byte rows (4 bytes x 63 = 252)
        t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        assert D.digest(t).sums == _by_definition(t), n
    t = torch.randn(300, 77, generator=torch.Generator().manual_seed(1)).to(dtype)
    whole = D.digest(t)
    assert whole.dtype == D.dtype_name(dtype) and whole.shape == (300, 77)
    assert D.digest(t.clone()) == whole
    assert D.digest(t.t().contiguous().t()) == whole  # a strided view of the same values: the same bytes


def test_any_single_bit_and_swaps_change_the_digest() -> None:
    t = _fp8(70_000)
    base = D.digest(t)
    raw = t.view(torch.uint8)
    for pos, bit in ((0, 0), (12_345, 7), (69_999, 3)):
        bad = raw.clone()
        bad[pos] ^= 1 << bit
        assert D.digest(bad.view(torch.float8_e4m3fn)) != base
    for i, j in ((0, 1), (5, 256), (100, 100 + 251), (7, 7 + 251 * 3)):  # same offset mod 251 too
        orig = raw.clone()
        orig[i], orig[j] = 3, 77  # two different bytes...
        swapped = orig.clone()
        swapped[i], swapped[j] = 77, 3  # ...trading places
        assert D.digest(swapped) != D.digest(orig), (i, j)
    assert D.digest(t.view(100, 700)) != base  # same bytes, other shape
    assert D.digest(_fp8(70_000, seed=2)) != base


def test_cast_to_the_held_dtype_first() -> None:
    sent = torch.randn(64, 32)
    held = sent.to(torch.bfloat16)  # a BF16 engine keeps the FP32 masters it was sent in BF16
    assert D.digest(sent, "bfloat16") == D.digest(held)
    assert D.digest(sent) != D.digest(held)
    with pytest.raises(KeyError, match="nope"):
        D.digests({"w": sent}, ["nope"])


def test_digests_read_back_together_equal_one_at_a_time() -> None:
    """``digests`` reads all sums of a device back at once; each entry is still that tensor's own digest, in
    the order asked, casts included, and an empty or 1-byte tensor is no special case."""
    named = {
        "a": torch.randn(300, 7),
        "b": _fp8(70_001, seed=1),
        "c": torch.randn(5).to(torch.bfloat16),
        "d": torch.zeros(0),
        "e": _fp8(1, seed=2),
    }
    names = ["c", "a", "e", "b", "d"]
    as_dtypes = {"a": "bfloat16"}
    got = D.digests(named, names, as_dtypes)
    assert list(got) == names
    for name in names:
        assert got[name] == D.digest(named[name], as_dtypes.get(name)), name
    assert got["a"].dtype == "bfloat16" and got["a"].sums == _by_definition(named["a"].to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_and_cpu_give_the_same_digest(dtype: torch.dtype) -> None:
    t = torch.randn(3000, 1537, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert D.digest(t.cuda()) == D.digest(t)
    assert D.digest(t.float().cuda(), D.dtype_name(dtype)) == D.digest(t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_launch_gpu_digests_equal_the_cpu_ones() -> None:
    """``digests`` of CUDA tensors runs one Triton launch over all of them (64 KiB chunks); each digest must
    equal the CPU's for the same bytes: sizes around the 251-byte rows and the chunk edges, an empty tensor,
    a non-contiguous one, casts, and all-0xFF bytes (the largest sums per chunk)."""
    g = torch.Generator().manual_seed(5)
    sizes = [0, 1, 250, 251, 252, 65_535, 65_536, 65_537, 3 * 65_536 + 7, 5_000_003]
    named = {f"u{n}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes}
    named["ff"] = torch.full((2 * 65_536 + 13,), 255, dtype=torch.uint8)
    named["fp8"] = _fp8(1536 * 1536 + 17, seed=6)
    named["bf16"] = torch.randn(8960, 153, generator=g).to(torch.bfloat16)
    named["strided"] = torch.randn(300, 400, generator=g).t()  # not contiguous
    named["cast"] = torch.randn(1000, 129, generator=g)
    as_dtypes = {"cast": "bfloat16"}
    names = list(named)
    on_gpu = {n: t.cuda() for n, t in named.items()}
    assert D.digests(on_gpu, names, as_dtypes) == D.digests(named, names, as_dtypes)
    assert D.digests(on_gpu, ["u0"]) == D.digests(named, ["u0"])  # only empty tensors: no launch
