"""The native engine's model runner path (own Qwen2 forward, slot KV cache, continuous batching, CUDA graphs).

CPU (float32): the runner path gives the eager transformers path's tokens, and log-probs within float32
summation noise, in BF16 and FP8 mode, with rows joining as others finish (fewer slots than rows), stop
tokens, greedy rows and weight updates landing in the fused buffers. GPU: graph replay equals eager decode of
the same runner bit for bit, the Triton attention and fused FP8 GEMM equal their references, and
release/resume frees the KV cache while the weights stay (the graphs captured again without warm-ups, same bits).
"""

from pathlib import Path

import pytest
import torch

from infir2_rl.algo.logprobs import token_logprobs
from infir2_rl.engines.native.engine import NativeEngine
from infir2_rl.fp8.linear import swap_to_fp8_training
from infir2_rl.models.factory import init_model, load_model
from infir2_rl.types import GenerateRequest, Sample, SamplingParams, WeightBucket

TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Single-threaded torch for this module (see conftest.one_thread)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


def _requests(max_new_tokens: int = 12, stop: tuple[int, ...] = ()) -> list[GenerateRequest]:
    hot = SamplingParams(temperature=0.9, max_new_tokens=max_new_tokens, stop_token_ids=list(stop))
    greedy = SamplingParams(greedy=True, max_new_tokens=max_new_tokens - 3)
    # Prompt lengths 4, 9, 14, 19: prompts of different lengths share a prefill (right-padded).
    return [
        GenerateRequest(
            f"r{i}", list(range(5, 9 + 5 * i)), n=3 - i % 2, params=greedy if i == 2 else hot, seed=i
        )
        for i in range(4)
    ]


def _assert_same(expected: list[Sample], got: list[Sample]) -> None:
    assert [(s.request_id, s.index) for s in got] == [(s.request_id, s.index) for s in expected]
    for a, b in zip(expected, got):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL


def _padded_rows(x_fp8: torch.Tensor, x_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized rows as a producer kernel leaves them (``fused_ops.QuantizedRows``): M padded to 16 with
    codes 0 and scales 1, scales K-block-major."""
    m, k = x_fp8.shape
    rows = -(-m // 16) * 16
    q_pad = torch.zeros(rows, k, dtype=torch.float8_e4m3fn, device=x_fp8.device)
    q_pad[:m] = x_fp8
    s_pad = torch.ones(x_scale.shape[1], rows, device=x_fp8.device)
    s_pad[:, :m] = x_scale.t()
    return q_pad, s_pad


STOP = (11, 40, 77, 123, 200)  # some rows stop early, so later rows join a running batch


def test_runner_path_gives_the_eager_paths_samples_with_fewer_slots_than_rows(model_dir: Path) -> None:
    eager = NativeEngine(str(model_dir), fp8=False, dtype="float32", device="cpu", decode_path="eager")
    runner = NativeEngine(
        str(model_dir), fp8=False, dtype="float32", device="cpu", decode_path="runner", max_batch_size=3
    )
    expected = eager.generate(_requests(stop=STOP))
    got = runner.generate(_requests(stop=STOP))
    _assert_same(expected, got)
    assert {s.finish_reason for s in got} == {"stop", "length"}
    assert runner.num_decode_steps > 0


def test_prompts_over_one_prefill_budget_are_admitted_together(model_dir: Path) -> None:
    """When the waiting prompts exceed one prefill's token budget, the scheduler runs several prefills before
    decoding, so every row decodes in one batch (before, half of them decoded 16 steps alone first), and the
    samples are those of the eager path."""
    runner = NativeEngine(
        str(model_dir), fp8=False, dtype="float32", device="cpu", decode_path="runner", max_batch_size=8
    )
    params = SamplingParams(temperature=0.9, max_new_tokens=6)
    requests = [
        GenerateRequest(f"r{i}", list(range(5, 15 + i)), n=1, params=params, seed=i) for i in range(8)
    ]
    scheduler = runner._scheduler
    scheduler.max_prefill_tokens = 48  # 4 prompts of 10-17 tokens per prefill
    got = runner.generate(requests)
    assert scheduler.tally["prefills"] == 3 and scheduler.tally["rows"] == 8
    assert dict(scheduler.steps_by_size) == {8: 5}  # 5 steps after the first token, all 8 rows at once
    eager = NativeEngine(str(model_dir), fp8=False, dtype="float32", device="cpu", decode_path="eager")
    _assert_same(eager.generate(requests), got)


def test_the_kv_cache_holds_the_calls_rows_not_max_batch_size(model_dir: Path) -> None:
    """The cache gets a slot per row of the call (rounded up to a graph batch size), not max_batch_size:
    10 rows -> 16 slots; a call with more rows grows it, one with fewer keeps it; samples are the eager
    path's either way. (An RL step of 64 rows x 16K tokens took 80% of an H200's free memory, 99 GiB, for
    max_batch_size=256 slots, where 64 slots need 29 GiB.)"""
    runner = NativeEngine(
        str(model_dir), fp8=False, dtype="float32", device="cpu", decode_path="runner", max_batch_size=256
    )
    eager = NativeEngine(str(model_dir), fp8=False, dtype="float32", device="cpu", decode_path="eager")
    scheduler = runner._scheduler
    requests = _requests(stop=STOP)  # 3 + 2 + 3 + 2 = 10 rows
    assert runner.kv_slots_short() is None  # no call yet
    _assert_same(eager.generate(requests), runner.generate(requests))
    assert scheduler.cache is not None and (scheduler.num_slots, scheduler.cache.num_slots) == (16, 16)
    assert runner.kv_slots_short() == 0  # every row decoded at once
    more = requests + [
        GenerateRequest(f"x{i}", list(range(7, 12)), n=4, params=requests[0].params, seed=10 + i)
        for i in range(3)
    ]  # 22 rows
    _assert_same(eager.generate(more), runner.generate(more))
    grown = scheduler.cache
    assert grown is not None and grown.num_slots == 24
    runner.generate(requests[:1])
    assert scheduler.cache is grown  # fewer rows: the allocation stays


def test_a_cache_cut_short_by_memory_is_kept_for_later_calls(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When memory gave fewer slots than the call wanted, later calls of that size keep the allocation (rows
    take turns in its slots) instead of reallocating, and capturing graphs again, every call."""
    runner = NativeEngine(
        str(model_dir), fp8=False, dtype="float32", device="cpu", decode_path="runner", max_batch_size=256
    )
    scheduler = runner._scheduler
    monkeypatch.setattr(scheduler, "_slots_that_fit", lambda length, wanted: min(wanted, 3))
    requests = _requests(stop=STOP)
    expected = NativeEngine(str(model_dir), fp8=False, dtype="float32", device="cpu").generate(requests)
    _assert_same(expected, runner.generate(requests))
    cache = scheduler.cache
    assert cache is not None and cache.num_slots == 3
    assert runner.kv_slots_short() == 16 - 3  # the RL step's rollout/kv_slots_short
    _assert_same(expected, runner.generate(requests))
    assert scheduler.cache is cache and runner.kv_slots_short() == 13


def test_the_memory_the_engine_asks_a_colocated_trainer_for_admits_every_row(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``memory_wanted`` (what a colocated trainer frees before a rollout, TorchTrainer.make_room) is the free
    memory at which the cache admits all the slots the last call wanted; any less admits fewer."""
    runner = NativeEngine(
        str(model_dir), fp8=False, dtype="float32", device="cpu", decode_path="runner", max_batch_size=256
    )
    assert runner.memory_wanted() is None  # no call yet
    runner.generate(_requests(stop=STOP))  # 10 rows: 16 slots wanted
    scheduler = runner._scheduler
    wanted_bytes = runner.memory_wanted()
    assert scheduler._last_ask is not None and wanted_bytes is not None
    slots, length = scheduler._last_ask
    assert slots == 16
    # _slots_that_fit's rule, as on a GPU with that much free memory:
    monkeypatch.setattr(scheduler.runner, "device", torch.device("cuda"))
    free = [wanted_bytes]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 10 * free[0]))
    assert scheduler._slots_that_fit(length, slots) == slots
    free[0] = wanted_bytes - scheduler._slot_bytes(length)
    assert scheduler._slots_that_fit(length, slots) < slots


def test_fp8_runner_log_probs_equal_the_fp8_trainer_forward(model_dir: Path) -> None:
    # FP8: the runner's fused GEMMs sum in another order than the eager path's, which can flip the e4m3
    # rounding of one activation element at a near-tie (test_engine_native.py: single log-probs move by up
    # to 2e-3; on _requests() one row of both paths is 2e-2 off the trainer at one token), and a flipped
    # token changes the rest of its row. So the runner's own samples are scored by the trainer's FP8
    # forward, on test_engine_native's requests and bounds (mean below TOL, max 5e-3).
    params = SamplingParams(temperature=0.7, max_new_tokens=10)
    reqs = [GenerateRequest(f"r{i}", list(range(5, 9 + 5 * i)), n=2, params=params, seed=i) for i in range(3)]
    runner = NativeEngine(
        str(model_dir), fp8=True, dtype="float32", device="cpu", decode_path="runner", max_batch_size=3
    )
    samples = runner.generate(reqs)
    trainer, _ = load_model(model_dir, dtype=torch.float32)
    swap_to_fp8_training(trainer)
    gaps = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = trainer(input_ids=ids).logits
        scored = token_logprobs(logits[:, :-1], ids[:, 1:], 0.7)
        gaps.append((scored[0, len(s.prompt_ids) - 1 :] - torch.tensor(s.logprobs)).abs())
    gap = torch.cat(gaps)
    assert gap.mean().item() < TOL and gap.max().item() < 5e-3


def test_weight_updates_reach_the_runners_fused_buffers(model_dir: Path, tmp_path: Path) -> None:
    other = init_model(tmp_path / "other", "tiny", seed=1)
    source, _ = load_model(other, dtype=torch.float32)
    state = source.state_dict()
    bucket = WeightBucket(1, 0, 1, list(state), list(state.values()))
    runner = NativeEngine(str(model_dir), fp8=False, dtype="float32", device="cpu", decode_path="runner")
    runner.update_weights(bucket)
    fresh = NativeEngine(str(other), fp8=False, dtype="float32", device="cpu", decode_path="eager")
    _assert_same(fresh.generate(_requests()), runner.generate(_requests()))


def test_unknown_decode_path_is_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="decode_path='graph'"):
        NativeEngine(str(model_dir), fp8=False, device="cpu", decode_path="graph")  # type: ignore[arg-type]


# ---- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_graph_decode_equals_eager_decode_bit_for_bit(model_dir: Path, fp8: bool) -> None:
    graphs = NativeEngine(str(model_dir), fp8=fp8, device="cuda", max_batch_size=4)
    graphs._scheduler.prefill_graphs = None  # decode graphs here; prefill graphs: test_prefill_graphs_gpu.py
    eager = NativeEngine(str(model_dir), fp8=fp8, device="cuda", max_batch_size=4, cuda_graphs=False)
    reqs = _requests(max_new_tokens=40, stop=(11, 40, 77, 123, 200))
    got = graphs.generate(reqs)
    # The same FP8 GEMM per shape (the choice is timed, so two engines could pick differently).
    eager._scheduler.runner.chooser.choice = graphs._scheduler.runner.chooser.choice
    expected = eager.generate(reqs)
    assert [s.response_ids for s in got] == [s.response_ids for s in expected]
    assert [s.logprobs for s in got] == [s.logprobs for s in expected]
    assert graphs._scheduler.decoder.graphs  # the graph path really replayed graphs
    sizes = len(graphs._scheduler.decoder.graphs)
    assert graphs._scheduler.decoder.warmups == 2 * sizes  # a first capture warms up
    assert graphs.graph_capture_s() > 0 and graphs.graph_capture_s() == 0.0  # since the last call
    before = torch.cuda.memory_allocated()
    graphs.release_memory()
    assert torch.cuda.memory_allocated() < before
    graphs.resume_memory()
    again = graphs.generate(reqs)
    assert [s.response_ids for s in again] == [s.response_ids for s in expected]
    assert [s.logprobs for s in again] == [s.logprobs for s in expected]
    # Captured again without warm-ups (the shapes were warmed up before the release), same bits.
    decoder = graphs._scheduler.decoder
    assert len(decoder.graphs) == sizes and decoder.warmups == 0
    assert graphs.graph_capture_s() > 0  # the re-capture, counted across the released decoder
    graphs.release_memory()
    graphs.resume_memory()
    graphs._scheduler.warmed = None  # warm up before every capture, as before session 41
    assert [s.logprobs for s in graphs.generate(reqs)] == [s.logprobs for s in expected]
    assert graphs._scheduler.decoder.warmups == 2 * sizes


@pytest.mark.gpu
def test_a_capture_on_a_new_thread_warms_up(model_dir: Path) -> None:
    # A threaded Ray actor runs each generate on any of its threads; torch makes a thread's cuBLAS handle on
    # its first GEMM, which must not happen inside a capture: a thread's first capture warms up.
    import threading

    engine = NativeEngine(str(model_dir), fp8=False, device="cuda", max_batch_size=4)
    reqs = _requests(max_new_tokens=20)
    expected = engine.generate(reqs)
    sizes = len(engine._scheduler.decoder.graphs)
    engine.release_memory()
    engine.resume_memory()
    got: list[list[Sample]] = []
    thread = threading.Thread(target=lambda: got.append(engine.generate(reqs)))
    thread.start()
    thread.join()
    assert got and [s.logprobs for s in got[0]] == [s.logprobs for s in expected]
    assert engine._scheduler.decoder.warmups == 2 * sizes


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_pdl_decode_equals_plain_launches(tmp_path_factory: pytest.TempPathFactory, fp8: bool) -> None:
    # Programmatic dependent launch lets each decode kernel start before the previous one ends
    # (engines/native/pdl.py); a kernel that touched its inputs before its wait would race and change bits.
    # Head dim 128, so the FP8 attention merge quantizes o_proj's input too; 64 rows at once.
    from infir2_rl.engines.native import fused_ops, pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs a GPU of compute capability 9.0+ and a Triton with grid dependency control")
    path = init_model(
        tmp_path_factory.mktemp("pdl") / "model", "100m",
        num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=4,
    )  # fmt: skip
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    reqs = [GenerateRequest(f"r{i}", list(range(5, 30 + i)), n=4, params=params, seed=i) for i in range(16)]
    with_pdl = NativeEngine(str(path), fp8=fp8, device="cuda", max_batch_size=64)
    got = with_pdl.generate(reqs)
    plain = NativeEngine(str(path), fp8=fp8, device="cuda", max_batch_size=64)
    plain._scheduler.runner.chooser.choice = with_pdl._scheduler.runner.chooser.choice  # same FP8 GEMMs
    with pdl.forced(False):
        expected = plain.generate(reqs)
    assert with_pdl._scheduler.decoder.graphs and plain._scheduler.decoder.graphs
    assert [s.response_ids for s in got] == [s.response_ids for s in expected]
    assert [s.logprobs for s in got] == [s.logprobs for s in expected]
    # Both kinds of launch really happened: the norm kernel was compiled with and without launch_pdl.
    compiled = [
        kernel.metadata.launch_pdl
        for kernel_cache, *_ in fused_ops._add_rms_norm_kernel.device_caches.values()  # Triton 3.6 layout
        for kernel in kernel_cache.values()
    ]
    assert True in compiled and False in compiled


def test_pdl_setting_follows_the_env_and_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    from infir2_rl.engines.native import pdl

    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl.requested()
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.requested()
    with pdl.forced(True):
        assert pdl.requested()
        with pdl.forced(False):
            assert not pdl.requested()
        assert pdl.requested()
    assert not pdl.requested()
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.requested() and not pdl.enabled(torch.device("cpu"))  # CPU never launches with PDL
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


@pytest.mark.gpu
def test_triton_decode_attention_equals_sdpa() -> None:
    from infir2_rl.engines.native import attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    slots, kv_heads, length, dim, heads = 6, 2, 300, 128, 12
    k = torch.randn(slots + 1, kv_heads, length, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(slots + 1, kv_heads, length, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(5, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    slot_ids = torch.tensor([3, 0, 6, 2, 3], device="cuda")
    lengths = torch.tensor([1, 37, 300, 129, 250], device="cuda")
    ref = attention.decode_sdpa(q.float(), k.float(), v.float(), slot_ids, lengths)
    out = attention.decode_triton(q, k, v, slot_ids, lengths).float()
    assert float((out - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("quant", [False, True])
def test_decode_attention_merged_by_the_last_split_is_exact_every_time(quant: bool, one_launch: bool) -> None:
    """The split that finishes last merges a row's partials (attention.decode_triton): whichever split that
    is, the row's result is the same bits (the merge runs in split order), equal to SDPA within BF16, and
    every launch leaves its arrival counts at zero. 256 rows of 1..2,048 keys over 8 splits: rows of one
    split (finished without a merge) and of all eight, in one launch, eager and replayed from a graph; and
    the same through the two launches (split kernel, merge kernel) that small batches take."""
    from infir2_rl.engines.native import attention

    gen = torch.Generator(device="cuda").manual_seed(3)
    rows, kv_heads, length, dim, heads = 256, 2, 2048, 128, 12
    k = torch.randn(rows + 1, kv_heads, length, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(rows + 1, kv_heads, length, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(rows, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    slots = torch.randperm(rows, device="cuda", generator=gen)
    lengths = torch.randint(1, length + 1, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    lengths[:4] = torch.tensor([1, 256, 257, length], device="cuda", dtype=torch.int32)  # 1, 1, 2, 8 splits
    arrivals = torch.zeros(rows * kv_heads, dtype=torch.int32, device="cuda")

    def run() -> list[torch.Tensor]:
        out = attention.decode_triton(q, k, v, slots, lengths, arrivals, quant=quant, one_launch=one_launch)
        return [out.q.view(torch.uint8), out.s_t] if quant else [out]

    first = run()
    plain = attention.decode_triton(q, k, v, slots, lengths, arrivals, one_launch=one_launch)
    assert isinstance(plain, torch.Tensor)
    ref = attention.decode_sdpa(q.float(), k.float(), v.float(), slots, lengths)
    assert float((plain.float() - ref).abs().max()) < 2e-2
    for _ in range(20):
        assert all(torch.equal(a, b) for a, b in zip(first, run(), strict=True))
    assert int(arrivals.abs().sum()) == 0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = run()
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(first, captured, strict=True))
    assert int(arrivals.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 50, 256])
def test_fused_fp8_gemm_equals_the_emulated_w8a8_linear(m: int) -> None:
    from infir2_rl.engines.native import fp8_gemm
    from infir2_rl.fp8.quant import (
        dequantize_weight_blockwise,
        fake_quantize_tiles,
        quantize_activation,
        quantize_weight_blockwise,
    )

    gen = torch.Generator(device="cuda").manual_seed(m)
    n, k = 384, 640  # 5 K blocks: split-K leaves an uneven last split
    x = torch.randn(
        m, k, device="cuda", generator=gen
    )  # FP32 in and out: the comparison is not rounded to BF16
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    bias = torch.randn(n, device="cuda", generator=gen)
    w_fp8, scale = quantize_weight_blockwise(w)
    ref = (
        fake_quantize_tiles(x).double() @ dequantize_weight_blockwise(w_fp8, scale).double().t()
        + bias.double()
    )
    x_fp8, x_scale = quantize_activation(x)
    q_pad, s_pad = _padded_rows(x_fp8, x_scale)
    # Hopper's FP8 tensor-core MMA (wgmma, the BM 64 configs) accumulates each 128-long block with fewer
    # bits than FP32 (DeepSeek-V3 report: ~14), ~1e-4 here; cuBLASLt's blockwise kernels do the same.
    for cfg in fp8_gemm.candidates(m, prequant=False):
        out = fp8_gemm.w8a8_fused(x, w_fp8, scale, bias, cfg)
        assert float((out.double() - ref).norm() / ref.norm()) < 5e-4, cfg
    for cfg in fp8_gemm.candidates(m):
        out = fp8_gemm.w8a8_fused(
            q_pad, w_fp8, scale, bias, cfg, x_scale_t=s_pad, rows=m, out_dtype=torch.float32
        )
        assert float((out.double() - ref).norm() / ref.norm()) < 5e-4, ("prequantized", cfg)


def test_split_partials_are_summed_as_the_sum_kernel_sums_them() -> None:
    from infir2_rl.engines.native import fused_ops

    gen = torch.Generator().manual_seed(0)
    part = torch.randn(3, 4, 256, generator=gen)
    partials = fused_ops.SplitPartials(part, torch.bfloat16)
    assert torch.equal(partials.total(), ((0.0 + part[0]) + part[1] + part[2]).to(torch.bfloat16))
    h0 = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    weight = torch.rand(256, generator=gen).to(torch.bfloat16)
    h1, h2 = h0.clone(), h0.clone()
    out1 = fused_ops.add_rms_norm(h1, partials.total(), weight, 1e-6)
    out2 = fused_ops.add_rms_norm(h2, partials, weight, 1e-6)
    assert torch.equal(h1, h2) and isinstance(out1, torch.Tensor) and isinstance(out2, torch.Tensor)
    assert torch.equal(out1, out2)
    with pytest.raises(ValueError, match="cannot be added"):
        fused_ops.add_rms_norm(h0.float(), partials, weight.float(), 1e-6)
    bias = torch.randn(256, generator=gen).to(torch.bfloat16)
    with_bias = fused_ops.SplitPartials(part, torch.bfloat16, bias)
    expected = ((0.0 + part[0]) + part[1] + part[2] + bias.float()).to(torch.bfloat16)
    assert torch.equal(with_bias.total(), expected)
    # q|k|v's partials (and bias) go to the rotary + KV-cache kernel: the same q, k and v as the sum
    heads, kv_heads, dim, length = 1, 1, 128, 8
    cos, sin = (torch.rand(length, dim, generator=gen).to(torch.bfloat16) for _ in "cs")
    positions, slots = torch.tensor([3, 0, 7, 1]), torch.tensor([0, 2, 1, 3])
    caches = [torch.zeros(5, kv_heads, length, dim, dtype=torch.bfloat16) for _ in range(4)]
    q1 = fused_ops.rope_write_kv(expected, positions, slots, cos, sin, *caches[:2], heads, kv_heads, 128, 0)
    q2 = fused_ops.rope_write_kv(with_bias, positions, slots, cos, sin, *caches[2:], heads, kv_heads, 128, 0)
    assert torch.equal(q1, q2) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("m", [5, 64])
def test_norm_after_a_split_k_gemm_sums_its_partials_bit_for_bit(m: int, quant: bool) -> None:
    """o_proj's and down_proj's split-K partials go unsummed to the add+RMSNorm after them (decode): its
    residual and output (BF16 or FP8 codes and scales) must equal those after the GEMM's own sum kernel,
    with and without a bias (Qwen2's have none; the kernel takes one)."""
    from infir2_rl.engines.native import fp8_gemm, fused_ops
    from infir2_rl.fp8.quant import quantize_activation, quantize_weight_blockwise

    gen = torch.Generator(device="cuda").manual_seed(m)
    e, k = 1536, 8960  # down_proj of the 1.5B shape
    w_fp8, scale = quantize_weight_blockwise(torch.randn(e, k, device="cuda", generator=gen) * 0.02)
    x_fp8, x_scale = quantize_activation(torch.randn(m, k, device="cuda", generator=gen))
    q_pad, s_pad = _padded_rows(x_fp8, x_scale)
    h0 = torch.randn(m, e, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.rand(e, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    bias = torch.randn(e, device="cuda", generator=gen).to(torch.bfloat16)
    for cfg, b in ((fp8_gemm.GemmConfig(64, 64, 8), None), (fp8_gemm.GemmConfig(64, 32, 4), bias)):
        args = (q_pad, w_fp8, scale, b, cfg, False, s_pad, m, torch.bfloat16)
        summed = fp8_gemm.w8a8_fused(*args)
        partials = fp8_gemm.w8a8_partials(*args)
        assert isinstance(partials, fused_ops.SplitPartials) and partials.part.shape[0] == cfg.split_k
        h1, h2 = h0.clone(), h0.clone()
        out1 = fused_ops.add_rms_norm(h1, summed, weight, 1e-6, quant)
        out2 = fused_ops.add_rms_norm(h2, partials, weight, 1e-6, quant)
        assert torch.equal(h1, h2), cfg
        if quant:
            assert isinstance(out1, fused_ops.QuantizedRows) and isinstance(out2, fused_ops.QuantizedRows)
            assert torch.equal(out1.q.view(torch.uint8), out2.q.view(torch.uint8)), cfg
            assert torch.equal(out1.s_t, out2.s_t), cfg
        else:
            assert isinstance(out1, torch.Tensor) and isinstance(out2, torch.Tensor)
            assert torch.equal(out1, out2), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("m", [5, 64])
def test_rotary_kv_write_after_a_split_k_gemm_sums_its_partials_bit_for_bit(m: int) -> None:
    """q|k|v's split-K partials and bias go unsummed to the rotary + KV-cache kernel (decode): q and the
    cache must equal those written from the GEMM's own sum kernel's output (1.5B shape: 12 q, 2 kv heads)."""
    from infir2_rl.engines.native import fp8_gemm, fused_ops
    from infir2_rl.fp8.quant import quantize_activation, quantize_weight_blockwise

    gen = torch.Generator(device="cuda").manual_seed(m)
    heads, kv_heads, dim, k, length = 12, 2, 128, 1536, 64
    n = (heads + 2 * kv_heads) * dim
    w_fp8, scale = quantize_weight_blockwise(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    x_fp8, x_scale = quantize_activation(torch.randn(m, k, device="cuda", generator=gen))
    q_pad, s_pad = _padded_rows(x_fp8, x_scale)
    cos = torch.rand(length, dim, device="cuda", generator=gen).to(torch.bfloat16)
    sin = torch.rand(length, dim, device="cuda", generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, length, (m,), device="cuda", generator=gen)
    slots = torch.randperm(m, device="cuda", generator=gen)
    for cfg in (fp8_gemm.GemmConfig(64, 32, 4), fp8_gemm.GemmConfig(16, 64, 8)):
        args = (q_pad, w_fp8, scale, bias, cfg, False, s_pad, m, torch.bfloat16)
        partials = fp8_gemm.w8a8_partials(*args)
        assert isinstance(partials, fused_ops.SplitPartials) and partials.bias is bias
        summed = fp8_gemm.w8a8_fused(*args)
        outs = []
        for qkv in (summed, partials):
            kc, vc = (
                torch.zeros(m + 1, kv_heads, length, dim, dtype=torch.bfloat16, device="cuda") for _ in "kv"
            )
            offsets = (heads * dim, (heads + kv_heads) * dim)
            q = fused_ops.rope_write_kv(qkv, positions, slots, cos, sin, kc, vc, heads, kv_heads, *offsets)
            outs.append((q, kc[slots, :, positions], vc[slots, :, positions]))
        for a, b in zip(*outs):
            assert torch.equal(a, b), cfg
        # and both are the rotation rounded as torch rounds it: each product to BF16, their FP32 sum to BF16
        heads_of = summed.view(m, heads + 2 * kv_heads, dim).float()
        c, s = cos[positions][:, None].float(), sin[positions][:, None].float()
        turned = torch.cat((-heads_of[..., dim // 2 :], heads_of[..., : dim // 2]), dim=-1)
        rotated = ((heads_of * c).bfloat16().float() + (turned * s).bfloat16().float()).bfloat16()
        assert torch.equal(outs[0][0], rotated[:, :heads]), cfg
        assert torch.equal(outs[0][1], rotated[:, heads : heads + kv_heads]), cfg
        assert torch.equal(outs[0][2], summed.view(m, -1, dim)[:, heads + kv_heads :]), cfg


@pytest.mark.gpu
def test_fp8_gemm_pipelines_its_tile_loads() -> None:
    """The decode GEMM is bound by how many weight bytes are in flight, and Triton turns its FP8 tile loads
    into asynchronous copies (``num_stages`` deep) only when it can prove 16-byte alignment: K and the row
    stride divisible by 16, as at every model shape. Checked on the compiled kernel's TTGIR, which is where
    the missing pipelining of the scale loads was found (docs/performance.md, session 19)."""
    from infir2_rl.engines.native import fp8_gemm
    from infir2_rl.fp8.quant import quantize_activation, quantize_weight_blockwise

    m, n, k = 64, 256, 1536
    w_fp8, scale = quantize_weight_blockwise(torch.randn(n, k, device="cuda") * 0.05)
    x_fp8, x_scale = quantize_activation(torch.randn(m, k, device="cuda"))
    fp8_gemm._w8a8_kernel.device_caches.clear()
    cfg = fp8_gemm.GemmConfig(64, 64, 1, 4, 3)
    fp8_gemm.w8a8_fused(x_fp8, w_fp8, scale, None, cfg, x_scale_t=x_scale.t().contiguous(), rows=m)
    kernels = [kern for cache in fp8_gemm._w8a8_kernel.device_caches.values() for kern in cache[0].values()]
    assert len(kernels) == 1
    ttgir = kernels[0].asm["ttgir"]
    # one copy per operand (q and w) in each of the num_stages - 1 prologue stages and in the loop
    assert ttgir.count("ttg.async_copy_global_to_local") == 2 * cfg.stages, ttgir


@pytest.mark.gpu
@pytest.mark.parametrize("m", [5, 16, 50])
def test_producer_quantizers_equal_the_trainers_quantizer_and_fill_the_padding(
    m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The norm, SiLU*up and decode attention kernels that quantize for the next GEMM give the codes and
    scales ``quant_triton.quantize_rows`` gives for their own BF16 output (the trainer's rule), and write
    the padding rows (codes 0, scale 1) themselves, on buffers that start as garbage."""
    from infir2_rl.engines.native import attention, fused_ops
    from infir2_rl.fp8 import quant_triton

    gen = torch.Generator(device="cuda").manual_seed(m)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    def check(qr: fused_ops.QuantizedRows, plain: torch.Tensor) -> None:
        q_ref, s_ref = quant_triton.quantize_rows(plain)
        rows = q_ref.shape[0]
        assert qr.m == m and qr.q.shape == q_ref.shape and qr.s_t.shape == s_ref.shape
        assert torch.equal(qr.q[:m].view(torch.uint8), q_ref[:m].view(torch.uint8))
        assert torch.equal(qr.s_t[:, :m], s_ref[:, :m])
        if rows > m:
            assert not qr.q[m:].view(torch.uint8).any()
            assert bool((qr.s_t[:, m:] == 1).all())

    real_buffers = fused_ops.quant_buffers

    def garbage_buffers(rows: int, k: int, device: torch.device) -> fused_ops.QuantizedRows:
        qr = real_buffers(rows, k, device)
        qr.q.view(torch.uint8).fill_(0x55)
        qr.s_t.fill_(float("nan"))
        return qr

    monkeypatch.setattr(fused_ops, "quant_buffers", garbage_buffers)  # the kernels must overwrite every byte
    h, delta, w = randn(m, 1536), randn(m, 1536), randn(1536)
    plain = fused_ops.add_rms_norm(h.clone(), delta, w, 1e-6)
    qr = fused_ops.add_rms_norm(h.clone(), delta, w, 1e-6, quant=True)
    assert isinstance(plain, torch.Tensor) and isinstance(qr, fused_ops.QuantizedRows)
    check(qr, plain)
    gate_up = randn(m, 2 * 8960)
    plain, qr = fused_ops.silu_mul(gate_up), fused_ops.silu_mul(gate_up, quant=True)
    assert isinstance(plain, torch.Tensor) and isinstance(qr, fused_ops.QuantizedRows)
    check(qr, plain)
    k, v = randn(m + 1, 2, 64, 128), randn(m + 1, 2, 64, 128)
    q = randn(m, 12, 128)
    slots = torch.arange(m, device="cuda")
    lengths = torch.randint(1, 65, (m,), device="cuda", generator=gen)
    plain = attention.decode(q, k, v, slots, lengths, "triton")
    qr = attention.decode(q, k, v, slots, lengths, "triton", quant=True)
    assert isinstance(plain, torch.Tensor) and isinstance(qr, fused_ops.QuantizedRows)
    check(qr, plain)


def test_fp8_gemm_choices_are_kept_per_decode_size_and_per_power_of_two_prefill() -> None:
    from infir2_rl.engines.native.linears import Fp8GemmChooser

    # Decode (producer-quantized) sizes are the graphs' padded batch sizes: each timed on its own.
    assert [Fp8GemmChooser.bucket(m, prequant=True) for m in (1, 24, 160, 256)] == [1, 24, 160, 256]
    # Prefill M follows the prompts: a bounded set of buckets, so new lengths reuse a timed choice.
    got = [Fp8GemmChooser.bucket(m, prequant=False) for m in (1, 100, 128, 129, 384, 512, 513, 8000)]
    assert got == [1, 128, 128, 256, 512, 512, 1024, 8192]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [1000, 151_936])
def test_chunked_triton_sampler_follows_the_torch_rule(vocab: int) -> None:
    """The graph path's sampler (vocabulary cut into chunks) against engines.sampling's torch rule: the same
    tokens except where u lands within FP32 summation error of a CDF boundary, log-probs to FP32 summation
    order, greedy = the first argmax, a row with nearly all mass on one token."""
    from infir2_rl.engines.native import sampler
    from infir2_rl.engines.sampling import RowSampling, sample_tokens, uniforms

    rows = 96
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 4).bfloat16()
    logits[5, 7] = logits[5, vocab - 3] = 60.0  # tied maximum on a greedy row: the first index wins
    logits[9] = -30.0
    logits[9, vocab // 2] = 40.0  # nearly all mass on one token, the rest underflows to 0
    greedy = [i % 8 == 5 for i in range(rows)]
    params = RowSampling.build(
        [1.0 + 0.1 * (i % 3) for i in range(rows)], [0] * rows, [1.0] * rows, greedy, list(range(rows)),
        vocab, torch.device("cuda"),
    )  # fmt: skip
    steps = torch.arange(rows, device="cuda") * 7
    tokens, logprobs = sampler.sample(logits, params, steps, truncating=False)
    ref_tokens, ref_logprobs = sample_tokens(logits, params, steps, truncating=False)
    # Tokens differ only where u * total lies within the FP32 summation error of the CDF boundary between
    # the two (torch scans 151,936 probabilities in another order: ~1e-6 there, against ~7e-6 per token).
    z = logits.double() / params.temperature_B.double()[:, None]
    cdf = torch.softmax(z, dim=-1).cumsum(dim=-1)
    target = uniforms(params.keys_B, steps).double()
    bad = (tokens != ref_tokens).nonzero().flatten().tolist()
    assert len(bad) <= 2, bad
    for r in bad:
        lo, hi = sorted((int(tokens[r]), int(ref_tokens[r])))
        assert abs(float(cdf[r, lo] - target[r])) < 2e-5 and abs(float(cdf[r, hi - 1] - target[r])) < 2e-5
    assert int(tokens[5]) == 7 and int(tokens[9]) == vocab // 2
    same = tokens == ref_tokens
    assert float((logprobs - ref_logprobs)[same].abs().max()) < 1e-4  # |log-prob| up to ~40 here
    z32 = logits.float() / params.temperature_B[:, None]
    own = torch.log_softmax(z32, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)  # the boundary rows too
    assert float((logprobs - own).abs().max()) < 1e-4
