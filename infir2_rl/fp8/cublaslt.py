"""The FP8 weight gradient added into an FP32 gradient by the GEMM itself: cuBLASLt with beta = 1, via ctypes.

Why: with FP32 masters (trainers/torch/master_weights.py) each FP8 linear's weight gradient dW = dY^T X came
out of ``F.scaled_mm`` as a new FP32 tensor, which the layer graphs then added into the master's gradient
(``main_grad``): 16 bytes of memory traffic per weight element and micro-batch (write dW, read dW and
``main_grad``, write ``main_grad``) where the GEMM's own epilogue needs 8 (read and write ``main_grad``).
``F.scaled_mm`` has no accumulate (beta) argument, so this module calls ``cublasLtMatmul`` directly, with the
operands, scale modes and layouts ``gemm.mm_1x128_1x128`` gives torch, and ``C = D = main_grad``, beta = 1.
The sum is the same FP32 value: alpha = beta = 1, so the epilogue rounds acc + C once, as the add did.

Nothing is compiled: the functions come from the ``libcublasLt`` torch has already loaded (found through
``/proc/self/maps``; ``INFIR2_CUBLASLT`` names another file). Descriptors and the heuristic's algorithm are
cached per problem; the workspace is one 1 MiB buffer per device (torch's size, so the heuristic picks the
algorithm ``F.scaled_mm`` runs), allocated by the first call, which is ``gemm``'s per-device check (before any
CUDA graph capture). A call is capturable: it runs on torch's current stream and passes alpha and beta from
host memory, read when the call is made (or captured).

Also ``mm_1x128_128x128_no_workspace``: the blockwise forward GEMM (``gemm.mm_1x128_128x128``'s operands) with
no workspace. With torch's 1 MiB workspace the heuristic gives the decode step's gate|up GEMM (M = 256, N =
17,920) a kernel with a dynamic tile scheduler, whose counter needs a memset before each launch (a second node
per call in the decode graph); without workspace it gives the static-scheduled variant of the same kernel,
which chains each tile's K blocks as the other does (the same bits) and ran 20.1 against 22.3 us there, the FP8
decode step 3.40 against 3.52 ms at batch 256 (H100, docs/performance.md, session 34).

And ``mm_1x128_128x128_into``: that forward GEMM over one K range of its operands (column slices, row stride
K), its FP32 result written or added (beta = 1) into ``out``: ``models/invariant_ops``' split GEMMs add their K
chunks this way, in order, the same FP32 sum as adding each chunk's own product (tested bit for bit).

Enum values are cuBLASLt's (cublasLt.h, CUDA 12.9 and 13); ``tests/test_fp8_cublaslt_gpu.py`` checks the
results against ``F.scaled_mm`` (plus an add for the wgrad), bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch

_CUDA_R_32F = 0
_CUDA_R_16BF = 14
_CUDA_R_8F_E4M3 = 28
_CUDA_TYPES = {torch.float32: _CUDA_R_32F, torch.bfloat16: _CUDA_R_16BF}
_CUBLAS_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_VEC128_32F = 4
_SCALE_BLK128X128_32F = 5
_PREF_MAX_WORKSPACE_BYTES = 1
_WORKSPACE_BYTES = 1 << 20  # torch's cuBLASLt workspace size (so: the same algorithm as F.scaled_mm)


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    pass


def _library_path() -> str:
    given = os.environ.get("INFIR2_CUBLASLT")
    if given:
        return given
    torch.cuda.current_blas_handle()  # makes sure torch's CUDA BLAS libraries are loaded
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if os.path.basename(path).startswith("libcublasLt.so"):
                return path
    raise CublasLtError("no libcublasLt is loaded in this process (set INFIR2_CUBLASLT to its path)")


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    protos = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [
            ctypes.POINTER(vp),
            i32,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int64,
        ],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [
            vp,
            vp,
            vp,
            vp,
            vp,
            vp,
            vp,
            i32,
            ctypes.POINTER(_HeuristicResult),
            ctypes.POINTER(i32),
        ],  # fmt: skip
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp],
    }
    for name, args in protos.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = i32
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} returned cuBLAS status {status}")


class _Problem:
    """One GEMM shape's descriptors and algorithm (kept for the process: a few per linear shape)."""

    def __init__(
        self,
        handle: ctypes.c_void_p,
        m: int,
        n: int,
        k: int,
        scales: tuple[int, int],
        a_mode: int = _SCALE_VEC128_32F,
        d_type: int = _CUDA_R_32F,
        workspace: int = _WORKSPACE_BYTES,
        lda: int = 0,
        ldb: int = 0,
    ) -> None:
        lib = _lib()
        self.op = ctypes.c_void_p()
        _check(
            lib.cublasLtMatmulDescCreate(ctypes.byref(self.op), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
            "DescCreate",
        )
        for attr, value in (
            (_DESC_TRANSA, _OP_T),
            (_DESC_TRANSB, _OP_N),
            (_DESC_A_SCALE_MODE, a_mode),
            (_DESC_B_SCALE_MODE, _SCALE_VEC128_32F),
        ):
            v = ctypes.c_int32(value)
            _check(
                lib.cublasLtMatmulDescSetAttribute(self.op, attr, ctypes.byref(v), 4),
                f"DescSetAttribute {attr}",
            )
        self.set_scales(*scales)  # the heuristic refuses VEC128 scaling without scale pointers (status 7)
        # Column-major: A is K x m (read transposed), B is K x n, C = D is m x n. lda / ldb: the operands'
        # leading dimensions (0: k; larger for a K slice of a wider matrix).
        self.la, self.lb, self.ld = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(
            lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.la), _CUDA_R_8F_E4M3, k, m, lda or k),
            "LayoutCreate A",
        )
        _check(
            lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.lb), _CUDA_R_8F_E4M3, k, n, ldb or k),
            "LayoutCreate B",
        )
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.ld), d_type, m, n, m), "LayoutCreate D")
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_size_t(workspace)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
            "PreferenceSetAttribute",
        )
        result, count = _HeuristicResult(), ctypes.c_int(0)
        _check(
            lib.cublasLtMatmulAlgoGetHeuristic(
                handle,
                self.op,
                self.la,
                self.lb,
                self.ld,
                self.ld,
                pref,
                1,
                ctypes.byref(result),
                ctypes.byref(count),
            ),
            "AlgoGetHeuristic",
        )
        if count.value < 1:
            raise CublasLtError(
                f"cuBLASLt has no algorithm for the FP8 GEMM m={m} n={n} k={k} (scale mode {a_mode})"
            )
        self.algo = result.algo
        self.workspace_size = result.workspace_size

    def set_scales(self, a_scale: int, b_scale: int) -> None:
        lib = _lib()
        for attr, address in ((_DESC_A_SCALE_POINTER, a_scale), (_DESC_B_SCALE_POINTER, b_scale)):
            ptr = ctypes.c_void_p(address)
            _check(lib.cublasLtMatmulDescSetAttribute(self.op, attr, ctypes.byref(ptr), 8), "scale pointer")


_lock = threading.Lock()
_handles: dict[int, ctypes.c_void_p] = {}
_workspaces: dict[int, torch.Tensor] = {}
_problems: dict[tuple[int, ...], _Problem] = {}  # (device, *key of _matmul) -> its problem
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)


def _handle_and_workspace(device: int) -> tuple[ctypes.c_void_p, torch.Tensor]:
    with _lock:
        if device not in _handles:
            handle = ctypes.c_void_p()
            _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            _handles[device] = handle
            _workspaces[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
        return _handles[device], _workspaces[device]


def _matmul(
    key: tuple[int, int, int, int, int, bool, int, int],
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    beta: ctypes.c_float,
) -> None:
    """``D = A^T B (* scales) + beta * D`` in cuBLAS's column-major terms, D = ``out``, on torch's current stream.
    ``key``: (m, n, k, A's scale mode, D's type, with workspace, lda, ldb): the problem (descriptors and
    algorithm) is made once per device and key. B's scales are always 1x128 vectors."""
    m, n, k, a_mode, d_type, use_workspace, lda, ldb = key
    device = out.device.index if out.device.index is not None else torch.cuda.current_device()
    handle, workspace = _handle_and_workspace(device)
    problem = _problems.get((device, *key))
    if problem is None:
        problem = _Problem(
            handle, m, n, k, (a_scale.data_ptr(), b_scale.data_ptr()),
            a_mode=a_mode, d_type=d_type, workspace=_WORKSPACE_BYTES if use_workspace else 0, lda=lda, ldb=ldb,
        )  # fmt: skip
        _problems[(device, *key)] = problem
    lib = _lib()
    stream = torch.cuda.current_stream(out.device).cuda_stream
    with _lock:  # the scale pointers live in the shared descriptor
        problem.set_scales(a_scale.data_ptr(), b_scale.data_ptr())
        _check(
            lib.cublasLtMatmul(
                handle, problem.op, ctypes.byref(_ONE),
                ctypes.c_void_p(a.data_ptr()), problem.la,
                ctypes.c_void_p(b.data_ptr()), problem.lb,
                ctypes.byref(beta), ctypes.c_void_p(out.data_ptr()), problem.ld,
                ctypes.c_void_p(out.data_ptr()), problem.ld,
                ctypes.byref(problem.algo), ctypes.c_void_p(workspace.data_ptr()), problem.workspace_size,
                ctypes.c_void_p(stream),
            ),
            "cublasLtMatmul",
        )  # fmt: skip


def add_mm_1x128_1x128(
    out: torch.Tensor,
    a_fp8: torch.Tensor,
    a_scale_t: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale_t: torch.Tensor,
    use_workspace: bool = True,
) -> None:
    """``out += (A * sA) @ (B * sB)^T`` in FP32, in place: A (M, K) e4m3 with a_scale_t (Kb, M); B (N, K) e4m3
    with b_scale_t (Kb, N); out (M, N) FP32 contiguous. The operands of ``gemm.mm_1x128_1x128`` (the wgrad:
    M, N the weight's out and in features, K the tokens). ``use_workspace=False``: the heuristic's algorithm
    without workspace (``bench/cublaslt_workspace.py --wgrad`` times both; the trainer keeps the default)."""
    m_rows, k = a_fp8.shape
    n_cols = b_fp8.shape[0]
    if out.dtype != torch.float32 or tuple(out.shape) != (m_rows, n_cols) or not out.is_contiguous():
        raise ValueError(f"add_mm_1x128_1x128: out must be FP32 ({m_rows}, {n_cols}) contiguous, got {out.dtype} "
                         f"{tuple(out.shape)}")  # fmt: skip
    for name, t in (("a", a_fp8), ("b", b_fp8), ("a_scale_t", a_scale_t), ("b_scale_t", b_scale_t)):
        if not t.is_contiguous():
            raise ValueError(f"add_mm_1x128_1x128: {name} must be contiguous")
    # torch's row-major out (M, N) is cuBLAS's column-major D (N x M): cuBLAS's A is our B, its B our A.
    key = (n_cols, m_rows, k, _SCALE_VEC128_32F, _CUDA_R_32F, use_workspace, k, k)
    _matmul(key, b_fp8, b_scale_t, a_fp8, a_scale_t, out, _ONE)


def mm_1x128_128x128_no_workspace(
    a_fp8: torch.Tensor,
    a_scale_t: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_grid: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``gemm.mm_1x128_128x128`` with no cuBLASLt workspace (module docstring): A (M, K) e4m3 with a_scale_t
    (Kb, M); W (N, K) e4m3 with w_scale_grid, the (Nb, round_up(Kb, 4)) row-major grid cuBLASLt reads
    (``gemm.padded_grid``). Returns (M, N) in out_dtype (BF16 or FP32)."""
    m_rows, k = a_fp8.shape
    n_cols = w_fp8.shape[0]
    if out_dtype not in _CUDA_TYPES:
        raise ValueError(f"mm_1x128_128x128_no_workspace: out_dtype must be BF16 or FP32, got {out_dtype}")
    for name, t in (("a", a_fp8), ("w", w_fp8), ("a_scale_t", a_scale_t), ("w_scale_grid", w_scale_grid)):
        if not t.is_contiguous():
            raise ValueError(f"mm_1x128_128x128_no_workspace: {name} must be contiguous")
    out = torch.empty(m_rows, n_cols, dtype=out_dtype, device=a_fp8.device)
    # As torch's scaled_mm: cuBLAS's A is W (block scales), its B is A (1x128 scales), D (N x M) column-major.
    key = (n_cols, m_rows, k, _SCALE_BLK128X128_32F, _CUDA_TYPES[out_dtype], False, k, k)
    _matmul(key, w_fp8, w_scale_grid, a_fp8, a_scale_t, out, _ZERO)
    return out


def mm_1x128_128x128_into(
    out: torch.Tensor,
    a_fp8: torch.Tensor,
    a_scale_t: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_grid: torch.Tensor,
    accumulate: bool,
    use_workspace: bool = True,
) -> None:
    """``out = (A * sA) @ (W * sW)^T (+ out if accumulate)`` in FP32, in place: the blockwise forward GEMM of
    ``mm_1x128_128x128_no_workspace``'s operands over one K range of wider matrices. A (M, Kc) and W (N, Kc)
    may be column slices (row stride >= Kc, the slice starting on a 128-column block); a_scale_t (Kbc, M) and
    w_scale_grid (Nb, round_up(Kbc, 4)) contiguous; out (M, N) FP32 contiguous. With ``accumulate`` the
    epilogue rounds acc + out once: K chunks added this way in order give the sum of the chunks' FP32 results
    in that order (``models/invariant_ops``' split GEMMs)."""
    m_rows, k = a_fp8.shape
    n_cols = w_fp8.shape[0]
    if out.dtype != torch.float32 or tuple(out.shape) != (m_rows, n_cols) or not out.is_contiguous():
        raise ValueError(f"mm_1x128_128x128_into: out must be FP32 ({m_rows}, {n_cols}) contiguous, got "
                         f"{out.dtype} {tuple(out.shape)}")  # fmt: skip
    for name, t in (("a", a_fp8), ("w", w_fp8)):
        if t.stride(1) != 1 or t.stride(0) < k or t.stride(0) % 16:
            raise ValueError(f"mm_1x128_128x128_into: {name} must be row-major with a row stride >= K, % 16")
    for name, t in (("a_scale_t", a_scale_t), ("w_scale_grid", w_scale_grid)):
        if not t.is_contiguous():
            raise ValueError(f"mm_1x128_128x128_into: {name} must be contiguous")
    key = (
        n_cols,
        m_rows,
        k,
        _SCALE_BLK128X128_32F,
        _CUDA_R_32F,
        use_workspace,
        w_fp8.stride(0),
        a_fp8.stride(0),
    )
    _matmul(key, w_fp8, w_scale_grid, a_fp8, a_scale_t, out, _ONE if accumulate else _ZERO)
