"""true_on_policy on a GPU: the trainer's log-probs of the engine's samples equal the engine's bit for bit.

The kernels first (a row's result does not depend on its batch), then the whole flow on a small random
Qwen2: NativeEngine(true_on_policy) samples with the weights TorchTrainer(true_on_policy) pushes, the
trainer scores the samples, and every scored token's log-prob must be exactly the engine's, in BF16 and in
unified FP8, at two temperatures, and after an optimizer step (whose FP8 bytes must reach the engine). The fast mode's gap is printed for contrast.
"""

from pathlib import Path

import pytest
import torch

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.models.factory import init_model

pytestmark = pytest.mark.gpu  # conftest skips it without a CUDA GPU; `pytest -m gpu` selects it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tp") / "small4", "small", seed=5, num_hidden_layers=4)


def test_gemm_rows_do_not_depend_on_the_batch() -> None:
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 384, device="cuda", generator=gen).bfloat16()
    w = torch.randn(1200, 384, device="cuda", generator=gen).bfloat16()
    b = torch.randn(1200, device="cuda", generator=gen).bfloat16()
    full = ops.mm(x, w, b)
    assert (full.float() - (x.float() @ w.float().t() + b.float())).abs().max() < 0.5
    for rows in (slice(0, 1), slice(3, 19), slice(500, 757)):
        assert torch.equal(ops.mm(x[rows], w, b), full[rows])


def test_fp8_gemm_rows_do_not_depend_on_the_batch() -> None:
    from infir2_rl.fp8.quant_triton import quantize_weight
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(700, 512, device="cuda", generator=gen).bfloat16()
    w_fp8, scale = quantize_weight(torch.randn(640, 512, device="cuda", generator=gen))
    full = ops.fp8_mm(x, w_fp8, scale, None, False)
    for rows in (slice(0, 1), slice(5, 37), slice(300, 700)):
        assert torch.equal(ops.fp8_mm(x[rows], w_fp8, scale, None, False), full[rows])


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_planned_gemms_give_decode_rows_the_trainers_bits(fp8: bool) -> None:
    """The 1.5B shapes as planned (cuBLAS, padded where it splits K at small M; or Triton): decode-sized
    batches, the engine's fused q|k|v among them, against the rows of a trainer-sized batch."""
    from infir2_rl.fp8.quant_triton import quantize_weight
    from infir2_rl.models import invariant_ops as ops

    groups = [(1536, [1536, 256, 256]), (8960, [1536])]
    print(ops.plan(groups, fp8, torch.device("cuda")))
    gen = torch.Generator(device="cuda").manual_seed(2)

    def gemm(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        return ops.fp8_mm(x, w[0], w[1], None, False) if w[1] is not None else ops.mm(x, w[0])

    for k, parts in groups:
        x = torch.randn(4096, k, device="cuda", generator=gen).bfloat16()
        weights: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for n in parts:
            w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
            weights.append(quantize_weight(w) if fp8 else (w.bfloat16(), None))
        fulls = [gemm(x, w) for w in weights]
        for w, full in zip(weights, fulls):
            for rows in (slice(0, 1), slice(7, 50), slice(100, 181), slice(1000, 1064), slice(2000, 4096)):
                assert torch.equal(gemm(x[rows], w), full[rows]), (k, w[0].shape, rows)
        if len(parts) > 1:  # the engine's fused weight
            fused = gemm(x[5:69], ops._fused_weight(weights))
            for start, n, full in zip(ops._fused_starts(parts, fp8), parts, fulls):
                assert torch.equal(fused[:, start : start + n], full[5:69])


@pytest.mark.parametrize("pow2", [False, True], ids=["scales", "pow2"])
def test_the_decode_steps_quantizing_kernels_give_the_walks_codes(pow2: bool) -> None:
    """Under true_on_policy the decode step's add+RMSNorm (at ``NORM_WARPS``) and SiLU*up kernels quantize the
    next GEMM's input; codes and scales must be the walk's ``quantize_rows`` of the walk's op, on 32,768 rows
    at the 1.5B shape (at the quantizing default of 16 warps the norm missed in 8 of them)."""
    from infir2_rl.engines.native import fused_ops
    from infir2_rl.fp8 import quant_triton
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(4)
    rows, hidden, inter = 32768, 1536, 8960

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    def same(got: object, walk: torch.Tensor) -> bool:
        assert isinstance(got, fused_ops.QuantizedRows)
        q, s_t = quant_triton.quantize_rows(walk, pow2)
        return torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.s_t, s_t)

    h, delta, w = rand(rows, hidden), rand(rows, hidden), rand(hidden, scale=0.1) + 1
    warps = fused_ops.NORM_WARPS
    assert same(
        fused_ops.add_rms_norm(h.clone(), delta, w, 1e-6, True, pow2, warps), ops.rms_norm(h + delta, w, 1e-6)
    )
    assert same(fused_ops.add_rms_norm(h, None, w, 1e-6, True, pow2, warps), ops.rms_norm(h, w, 1e-6))
    gate_up = rand(rows // 4, 2 * inter, scale=3.0)
    assert same(fused_ops.silu_mul(gate_up, True, pow2), ops.silu_mul(gate_up[:, :inter], gate_up[:, inter:]))
    # The attention kernel quantizing o_proj's input (head dim 128): 1,000 decode rows (buffers padded to
    # 1,008) over a cache of 8 slots, at assorted lengths.
    heads, kv_heads, dim, slots, length, n = 12, 2, 128, 8, 300, 1000
    cache_k, cache_v = rand(slots, kv_heads, length, dim), rand(slots, kv_heads, length, dim)
    q = rand(n, heads, dim)
    seq = torch.randint(0, slots, (n,), device="cuda", generator=gen)
    lens = torch.randint(1, length + 1, (n,), device="cuda", generator=gen).to(torch.int32)
    assert same(
        ops.attention_quantized(q, cache_k, cache_v, seq, lens, pow2),
        ops.attention(q, cache_k, cache_v, seq, lens),
    )


def test_the_walks_gemm_adds_its_weight_gradient_into_the_named_fp32_target() -> None:
    """A BF16 weight that names an FP32 gradient target (``WGRAD_INTO``, as the trainer's masters do) gets dW
    added there by the GEMM, nothing in ``.grad``; the target ends as its old value plus dW in FP32. A weight
    naming none gets its BF16 dW back as before."""
    from infir2_rl.fp8.ops import WGRAD_INTO
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(300, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(300, 384, device="cuda", generator=gen).bfloat16()
    named = torch.nn.Parameter((torch.randn(384, 256, device="cuda", generator=gen) * 0.05).bfloat16())
    plain = torch.nn.Parameter(named.detach().clone())
    start = torch.randn(384, 256, device="cuda", generator=gen)
    target = start.clone()
    setattr(named, WGRAD_INTO, lambda p: target)
    ops.mm(x, named).backward(dy)
    dx_named = x.grad.clone()
    x.grad = None
    ops.mm(x, plain).backward(dy)
    assert named.grad is None and plain.grad is not None and torch.equal(x.grad, dx_named)
    expected = torch.addmm(start, dy.t().float(), x.detach().float())
    torch.testing.assert_close(target, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(target - start, plain.grad.float(), rtol=1e-2, atol=1e-2)  # BF16 dW's rounding


def test_a_padded_bf16_plan_reads_the_rows_past_its_input_instead_of_copying() -> None:
    """A GEMM planned at more rows than its input (cuBLAS splits K below them) multiplies the rows that follow
    the input in its storage (``fused_ops.silu_mul(rows=...)`` leaves them unwritten): a row's product does not
    read other rows, so its bits are those of the zero-padded copy."""
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(6)
    buf = torch.randn(300, 8960, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(1536, 8960, device="cuda", generator=gen) * 0.02).bfloat16()
    x, copy = buf[:256], buf[:256].clone()
    assert ops._has_rows(x, 272) and not ops._has_rows(copy, 272) and not ops._has_rows(buf[:, :4480], 272)
    assert torch.equal(
        ops._cublas(x, (w, None), None, 272, torch.bfloat16),
        ops._cublas(copy, (w, None), None, 272, torch.bfloat16),
    )


def test_decode_attention_over_a_cache_equals_the_full_sequence_rows() -> None:
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(2)
    batch, length, heads, kv_heads, dim = 3, 150, 6, 2, 64
    q = torch.randn(batch, length, heads, dim, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(batch, kv_heads, length, dim, device="cuda", generator=gen).bfloat16() for _ in "kv")
    full = ops.causal_attention(q, k, v)  # (B, L, H*D)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.repeat_interleave(3, 1).float(), v.repeat_interleave(3, 1).float(),
        is_causal=True,
    ).transpose(1, 2).reshape(batch, length, -1)  # fmt: skip
    assert (full.float() - ref).abs().max() < 2e-2
    # A cache of 5 slots holding the sequences in slots 4, 0, 2 (longer than the sequences), decode rows at
    # assorted positions.
    cache_k = torch.zeros(5, kv_heads, 256, dim, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.zeros_like(cache_k)
    slots = torch.tensor([4, 0, 2], device="cuda")
    cache_k[slots, :, :length], cache_v[slots, :, :length] = k, v
    rows_b = torch.tensor([0, 1, 2, 2, 0, 1], device="cuda")
    rows_t = torch.tensor([0, 63, 64, 149, 100, 127], device="cuda")
    out = ops.attention(q[rows_b, rows_t], cache_k, cache_v, slots[rows_b], (rows_t + 1).int())
    assert torch.equal(out, full[rows_b, rows_t])


def test_the_scorers_log_sum_exp_is_the_samplers_without_its_argmax() -> None:
    from infir2_rl.engines.native import sampler

    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(70, 151_936, device="cuda", generator=gen) * 4).bfloat16()
    temps = torch.full((70,), 1.1, device="cuda")
    with_argmax, top = sampler._lse_and_argmax(logits, temps)
    assert top is not None and torch.equal(top.long(), (logits.float() / temps[:, None]).argmax(1))
    assert torch.equal(sampler.logsumexp(logits, temps), with_argmax)


@pytest.mark.parametrize("heads, dim", [(12, 128), (6, 64)])
def test_whole_sequences_attend_with_the_one_token_kernels_bits(heads: int, dim: int) -> None:
    """``causal_rows`` gives a program several consecutive tokens (shared K/V loads): the engine decodes
    with the one-token kernel, so each row must keep that kernel's bits, at lengths that are no multiple of
    the tokens per program or of the key block."""
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(4)
    for batch, length in ((3, 150), (2, 257), (1, 1)):
        q = torch.randn(batch * length, heads, dim, device="cuda", generator=gen).bfloat16()
        k, v = (torch.randn(batch, 2, length, dim, device="cuda", generator=gen).bfloat16() for _ in "kv")
        one = ops.causal_rows(q, k, v, tokens=1)
        for tokens in (None, 2):  # None: the default, as many as fill ATTN_TILE_ROWS (4 and 8 tokens here)
            assert torch.equal(ops.causal_rows(q, k, v, tokens=tokens), one), (batch, length, tokens)


@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "fp8"])
def test_attention_bits_do_not_depend_on_its_pipeline_depth(quant: bool) -> None:
    """The launch picks its depth by the grid's size (the engine's decode batch, the trainer's tokens), so
    every depth must give the same bits, quantized output included."""
    from infir2_rl.engines.native import fused_ops
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(3)
    rows, heads, kv_heads, dim, num_seqs, length = 40, 12, 2, 128, 6, 300
    q = torch.randn(rows, heads, dim, device="cuda", generator=gen).bfloat16()
    k, v = (
        torch.randn(num_seqs, kv_heads, length, dim, device="cuda", generator=gen).bfloat16() for _ in "kv"
    )
    seq = torch.randint(0, num_seqs, (rows,), device="cuda", generator=gen)
    lens = torch.randint(1, length + 1, (rows,), device="cuda", generator=gen).int()
    results = []
    for stages in (None, 1, 2, 3, 4):
        out = torch.empty(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
        codes = fused_ops.quant_buffers(rows, heads * dim, q.device) if quant else None
        ops._launch_attention(q, k, v, seq, lens, q if quant else out, codes, False, stages)
        results.append((codes.q.view(torch.uint8), codes.s_t) if codes is not None else (out,))
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other, strict=True))


@pytest.mark.parametrize("hidden, heads, kv_heads, inter", [(384, 6, 2, 1024), (1536, 12, 2, 8960)])
def test_the_decode_steps_fused_kernels_compute_the_walks_ops_bit_for_bit(
    hidden: int, heads: int, kv_heads: int, inter: int
) -> None:
    """Each fused kernel the true_on_policy decode step keeps, against the op of the walk it stands for, on
    thousands of rows (a kernel that rounds differently in 8 rows of 32,768 breaks bit equality at 1.5B:
    the quantizing RMSNorm did, which is why true_on_policy decode quantizes with the walk's quantizer)."""
    from infir2_rl.engines.native import fused_ops
    from infir2_rl.fp8.quant_triton import quantize_weight
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(3)
    rows, dim = 4096, hidden // heads

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    h, delta, w = rand(rows, hidden), rand(rows, hidden), rand(hidden, scale=0.1) + 1
    # residual add + RMSNorm in one kernel vs torch's add, then the norm kernel
    walk = ops.rms_norm(h + delta, w, 1e-6)
    fused_h = h.clone()
    assert torch.equal(fused_ops.add_rms_norm(fused_h, delta, w, 1e-6), walk)
    assert torch.equal(fused_h, h + delta)
    # SiLU * up of a fused gate|up output vs the walk's two halves
    gate_up = rand(rows, 2 * inter, scale=3.0)
    assert torch.equal(fused_ops.silu_mul(gate_up), ops.silu_mul(gate_up[:, :inter], gate_up[:, inter:]))
    # rotary embedding + KV write (decode) vs the walk's rotation (the same kernel, k written to a plain tensor)
    qkv = rand(rows, (heads + 2 * kv_heads) * dim)
    positions = torch.randint(0, 500, (rows,), device="cuda", generator=gen)
    cos, sin = rand(512, dim), rand(512, dim)
    k_cache = torch.zeros(rows + 1, kv_heads, 512, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(rows, device="cuda")
    k_off, v_off = heads * dim, (heads + kv_heads) * dim
    q = fused_ops.rope_write_kv(
        qkv, positions, slots, cos, sin, k_cache, v_cache, heads, kv_heads, k_off, v_off
    )
    q_walk, k_walk = ops.rope(
        qkv[:, :k_off].view(rows, heads, dim),
        qkv[:, k_off:v_off].view(rows, kv_heads, dim),
        positions,
        cos,
        sin,
    )
    assert torch.equal(q, q_walk) and torch.equal(k_cache[slots, :, positions], k_walk)
    # and torch's op-by-op rotation, bit for bit at head dims 64 and 128 (before session 20 the kernel was
    # compiled with FMA contraction and missed one product's rounding at head dim 64)
    c, s = cos[positions][:, None], sin[positions][:, None]
    assert torch.equal(q, fused_ops.rotate_torch(qkv[:, :k_off].view(rows, heads, dim), c, s))
    assert torch.equal(k_walk, fused_ops.rotate_torch(qkv[:, k_off:v_off].view(rows, kv_heads, dim), c, s))
    # fused q|k|v at decode size vs the walk's separate GEMMs at a trainer's M
    x, wq, wk = (
        rand(37, hidden),
        rand(heads * dim, hidden, scale=0.05),
        rand(kv_heads * dim, hidden, scale=0.05),
    )
    big = torch.cat([x, rand(1000, hidden)])
    fused = ops.mm(x, torch.cat([wq, wk]))
    assert torch.equal(fused[:, : heads * dim], ops.mm(big, wq)[:37])
    assert torch.equal(fused[:, heads * dim :], ops.mm(big, wk)[:37])
    # FP8: fused q|k weights (their own scale blocks) at decode size vs the walk's separate GEMMs at a
    # trainer's M, both quantizing the norm's BF16 output with the trainer's quantizer
    (q8, qs), (k8, ks) = quantize_weight(wq.float()), quantize_weight(wk.float())
    normed = fused_ops.add_rms_norm(x.clone(), None, w, 1e-6)
    walk_x = ops.rms_norm(big, w, 1e-6)
    assert torch.equal(normed, walk_x[:37])
    fused8 = ops.fp8_mm(normed, torch.cat([q8, k8]), torch.cat([qs, ks]), None, False)
    assert torch.equal(fused8[:, : heads * dim], ops.fp8_mm(walk_x, q8, qs, None, False)[:37])
    assert torch.equal(fused8[:, heads * dim :], ops.fp8_mm(walk_x, k8, ks, None, False)[:37])


def _trainer(  # type: ignore[no-untyped-def]
    model_dir: Path, fp8: bool, true_on_policy: bool, graphs: bool | str = "auto", param_dtype: str = "auto"
):
    from infir2_rl.trainers.torch.trainer import TorchTrainer

    return TorchTrainer(
        ModelConfig(path=str(model_dir)),
        TrainerConfig(micro_batch_size=8, cuda_graphs=graphs, param_dtype=param_dtype),  # type: ignore[arg-type]
        OptimizerConfig(),
        fp8=fp8,
        total_steps=1,
        true_on_policy=true_on_policy,
    )


def _round(trainer, engine, version: int, temperature: float, fp8: bool):  # type: ignore[no-untyped-def]
    """Push the trainer's weights, sample, score: (trainer log-probs, engine log-probs, loss mask) per batch."""
    from infir2_rl.rollout.batch import RolloutBatch, to_token_batches
    from infir2_rl.types import GenerateRequest, SamplingParams
    from infir2_rl.weight_sync.buckets import build_buckets

    for bucket in build_buckets(trainer.export_weights(fp8=fp8), 1 << 30, version=version):
        engine.update_weights(bucket)
    gen = torch.Generator().manual_seed(version)
    params = SamplingParams(temperature=temperature, max_new_tokens=40)
    requests = [
        GenerateRequest(
            f"r{i}", torch.randint(10, 300, (5 + 7 * i,), generator=gen).tolist(), n=4, params=params, seed=i
        )
        for i in range(6)
    ]
    samples = sorted(engine.generate(requests), key=lambda s: (s.request_id, s.index))
    batch = RolloutBatch(samples=samples, rewards=[0.0] * 24, group_size=4, labels=["0"] * 6)
    tokens = to_token_batches(batch, torch.zeros(24), pad_id=0, micro_batch_size=8)
    logps = trainer.forward_logprobs(tokens, temperature=temperature)
    scored = [
        (lp[:, 1:], tb.rollout_logprobs[:, 1:], tb.loss_mask[:, 1:] > 0) for lp, tb in zip(logps, tokens)
    ]
    return scored, tokens


@pytest.mark.parametrize(
    "graphs, param_dtype",
    [(False, "float32"), (False, "bfloat16"), (True, "bfloat16")],
    ids=["eager-fp32_params", "eager-bf16_params", "graphs-bf16_params"],
)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "unified_fp8"])
def test_trainer_log_probs_equal_the_engine_bit_for_bit(
    model_dir: Path, fp8: bool, graphs: bool, param_dtype: str
) -> None:
    """FP32 parameters cast by the walk, or a BF16 model with FP32 masters (kept FP8 weights in FP8), eager or
    with the decoder layers replayed from CUDA graphs (the GPU default: graphs and BF16 parameters), which
    capture the walk's layers for scoring (forward only) and for training."""
    from infir2_rl.engines.native.engine import NativeEngine

    trainer = _trainer(model_dir, fp8, True, graphs, param_dtype)
    assert (trainer.layer_graphs is not None) == graphs
    assert (trainer.master_weights is not None) == (param_dtype == "bfloat16")
    engine = NativeEngine(str(model_dir), fp8=fp8, max_batch_size=8, true_on_policy=True)
    from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens

    scored = 0
    for version, temperature in ((1, 1.0), (2, 1.1)):
        results, tokens = _round(trainer, engine, version, temperature, fp8)
        for train_lp, engine_lp, mask in results:
            diff = (train_lp - engine_lp)[mask]
            scored += int(mask.sum())
            assert diff.abs().max().item() == 0.0, f"max |dlogp| {diff.abs().max().item():.3e}"
        # An optimizer step (the flat AdamW with the BF16 model, torch's fused one with FP32 parameters) before the
        # next round's push: its bytes reach both sides.
        trainer.train_step(tokens, SftLossFn(), sum(num_target_tokens(t) for t in tokens))
        # As a colocated engine between rollouts: the next round re-captures its decode graphs, without the
        # warm-ups for shapes this thread captured before (cuda_graphs.py), and must give the same bits.
        engine.release_memory()
        engine.resume_memory()
    assert scored > 500
    assert engine._scheduler.tally["graph_prefills"] > 0  # the prefills of this test replay the walk's graphs
    if graphs:  # both kinds captured and replayed, not run eagerly past them
        kinds = {g.forward_only for g in trainer.layer_graphs._shapes.values()}
        assert kinds == {False, True} and trainer.layer_graphs.replays >= 8


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "unified_fp8"])
def test_the_graphed_prefill_gives_the_eager_walks_bits(model_dir: Path, fp8: bool) -> None:
    """A prefill replayed from its bucket's graph (pad prompts, pad positions) writes the same keys and values
    into the cache and returns the same logits as the eager walk over the unpadded prompts."""
    from infir2_rl.engines.native.engine import NativeEngine

    engine = NativeEngine(str(model_dir), fp8=fp8, max_batch_size=8, true_on_policy=True)
    runner, graphs = engine._scheduler.runner, engine._scheduler.prefill_graphs
    assert graphs is not None and graphs.bucket(3, 40) == (4, 64)
    dev = runner.device
    lengths = torch.tensor([5, 17, 40], device=dev)
    ids = torch.randint(10, 300, (3, 40), generator=torch.Generator().manual_seed(0)).to(dev)
    ids[0, 5:], ids[1, 17:] = 0, 0
    slots, prompt_of_row = torch.tensor([0, 1, 2, 3], device=dev), torch.tensor([0, 0, 1, 2], device=dev)
    eager_cache, graph_cache = runner.new_cache(4, 64), runner.new_cache(4, 64)
    eager = runner.prefill(ids, lengths, eager_cache, slots, prompt_of_row)
    for _ in range(2):  # the capture's run, then a replay
        graphed = graphs.run(ids, lengths, graph_cache, slots, prompt_of_row)
    assert torch.equal(graphed, eager)
    for row, prompt in enumerate(prompt_of_row.tolist()):
        n = int(lengths[prompt])
        for cache in (eager_cache, graph_cache):
            assert cache.buffer[:, :, row, :, :n].abs().sum() > 0  # written
        assert torch.equal(graph_cache.buffer[:, :, row, :, :n], eager_cache.buffer[:, :, row, :, :n])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_split_k_plan_gives_the_trainers_bits(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, graphs: bool
) -> None:
    """FP8 down_proj planned in K chunks (forced: at this model's K the plan would not split it): the
    engine's decode hands the split-K launch's partials to its norm kernel, batches above 512 rows run
    cuBLASLt per chunk, and every log-prob still equals the engine's."""
    from collections import Counter

    from infir2_rl.engines.native.engine import NativeEngine
    from infir2_rl.fp8 import cublaslt
    from infir2_rl.models import invariant, invariant_ops

    for name in ("_PLAN", "_PLAN_LINES", "_SPLIT", "_NO_WORKSPACE"):  # a fresh plan for this test's shapes
        monkeypatch.setattr(invariant_ops, name, {})
    monkeypatch.setattr(invariant_ops, "_IN_FUSED", set())
    monkeypatch.setattr(invariant_ops, "_split_wanted", lambda n, k: True)
    calls: Counter[str] = Counter()
    partials, chunk = invariant_ops._split_partials, cublaslt.mm_1x128_128x128_into
    monkeypatch.setattr(invariant_ops, "_split_partials", lambda *a: calls.update(["triton"]) or partials(*a))
    monkeypatch.setattr(cublaslt, "mm_1x128_128x128_into", lambda *a: calls.update(["cublaslt"]) or chunk(*a))

    trainer = _trainer(model_dir, True, True, graphs, "bfloat16")
    lines = invariant.plan_gemms(trainer.model, trainer.device)
    split = [line for line in lines if "chunks" in line]
    assert len(split) == 1 and "N 384" in split[0] and "FP8" in split[0], lines  # down_proj (o is q's shape)
    engine = NativeEngine(str(model_dir), fp8=True, max_batch_size=8, true_on_policy=True)
    calls.clear()  # the plan's probe ran both forms; count the runs'
    results, _ = _round(trainer, engine, 1, 1.0, True)
    for train_lp, engine_lp, mask in results:
        assert (train_lp - engine_lp)[mask].abs().max().item() == 0.0
    assert calls["triton"] > 0 and calls["cublaslt"] > 0, calls


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "unified_fp8"])
def test_head_dim_128_decodes_the_trainers_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fp8: bool
) -> None:
    """Head dim 128, where the FP8 decode's attention kernel quantizes o_proj's input itself
    (``invariant_ops.attention_quantized``), with the graphed BF16 trainer (the GPU default)."""
    from infir2_rl.engines.native.engine import NativeEngine
    from infir2_rl.models import invariant_ops

    calls = []
    quantized = invariant_ops.attention_quantized
    monkeypatch.setattr(
        invariant_ops,
        "attention_quantized",
        lambda *a: calls.append(1) or quantized(*a),  # type: ignore[func-returns-value]
    )

    path = init_model(tmp_path / "hd128", "small", seed=7, num_hidden_layers=3, hidden_size=512,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=1408)  # fmt: skip
    trainer = _trainer(path, fp8, True, True, "bfloat16")
    engine = NativeEngine(str(path), fp8=fp8, max_batch_size=8, true_on_policy=True)
    results, _ = _round(trainer, engine, 1, 1.0, fp8)
    for train_lp, engine_lp, mask in results:
        assert (train_lp - engine_lp)[mask].abs().max().item() == 0.0
    assert bool(calls) == fp8  # (captured into the decode graphs: called at capture)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "unified_fp8"])
def test_graphed_walk_trains_as_the_eager_walk(model_dir: Path, fp8: bool) -> None:
    """One step's gradients over the same micro-batches, eager and from the graphs: the same loss (the forward
    is bit-equal) and the same gradients up to the backward's algorithm choices (cuBLAS and SDPA may pick
    others inside a capture)."""
    from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens
    from infir2_rl.trainers.layer_graphs import grad_target
    from infir2_rl.types import TokenBatch

    gen = torch.Generator().manual_seed(3)
    batches = []
    for rows, length in ((8, 64), (8, 72), (5, 64)):  # bucket lengths: the graphed step pads nothing
        ids = torch.randint(10, 300, (rows, length), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, length // 2 :] = 0  # a shorter row
        batches.append(TokenBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.clone().float()))
    units = sum(num_target_tokens(b) for b in batches)
    grads, losses = [], []
    for graphs in (False, True):
        trainer = _trainer(model_dir, fp8, True, graphs)
        seen: dict[str, torch.Tensor] = {}
        norm = trainer._grad_norm

        def grab(trainer=trainer, seen=seen, norm=norm):  # type: ignore[no-untyped-def]
            for n, p in trainer.model.named_parameters():
                g = grad_target(p)  # the FP32 master's gradient (BF16 model, the default) or .grad
                if g is not None:
                    seen[n] = g.clone()
            return norm()

        trainer._grad_norm = grab
        losses.append(trainer.train_step(batches, SftLossFn(), units).loss)
        assert (trainer.layer_graphs is not None and trainer.layer_graphs.replays == 3) == graphs
        grads.append(seen)
        del trainer
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for name, eager in grads[0].items():
        rel = (grads[1][name] - eager).norm() / eager.norm().clamp_min(1e-12)
        assert rel < 1e-2, f"{name}: relative gradient difference {rel:.2e}"


def test_fast_mode_is_not_bit_equal(model_dir: Path) -> None:
    """The contrast the setting exists for: without it the same flow differs (so the test above can fail)."""
    from infir2_rl.engines.native.engine import NativeEngine

    trainer = _trainer(model_dir, True, False)
    engine = NativeEngine(str(model_dir), fp8=True, max_batch_size=8)
    diffs = [(t - e)[m].abs().max().item() for t, e, m in _round(trainer, engine, 1, 1.0, True)[0]]
    print(f"fast mode unified FP8 max |dlogp| per batch: {diffs}")
    assert max(diffs) > 0


def test_walk_gradients_match_transformers(model_dir: Path) -> None:
    """The walk's backward on the GPU (its RMSNorm, SiLU*up, rotary embedding and the log-softmax's gradient
    through the trainer's fused backward kernels, the rest plain torch) against transformers' autograd of the
    same loss: BF16 rounding apart, the same gradients."""
    from transformers import AutoModelForCausalLM

    from infir2_rl.trainers.torch import invariant_scoring

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    ids = torch.randint(10, 300, (3, 40), generator=torch.Generator().manual_seed(2)).cuda()
    select = torch.ones_like(ids, dtype=torch.bool)
    logp, _ = invariant_scoring.score_tokens(model, ids, select, temperature=1.0, need_entropy=False)
    logits = model(input_ids=ids).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
    params = [p for p in model.parameters() if p.requires_grad]
    walk = torch.autograd.grad(logp[:, 1:].sum(), params)
    hf = torch.autograd.grad(ref.sum(), params)
    for (name, _), a, b in zip(model.named_parameters(), walk, hf, strict=True):
        rel = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
        assert rel < 0.05, f"{name}: relative gradient difference {rel:.3f}"
