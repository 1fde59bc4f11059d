"""Token scores without full logits (trainers/token_scores.py, trainers/torch/scoring.py) against the plain
path through the model's logits, and packed micro-batches against padded ones."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from infir2_rl.algo.logprobs import entropy_from_logits, scores_from_logits, token_logprobs
from infir2_rl.trainers.token_scores import chunked_token_scores
from infir2_rl.trainers.torch.scoring import score_tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_scores_and_gradients_equal_the_logits_path(temperature: float) -> None:
    torch.manual_seed(0)
    n, h, v = 37, 16, 50
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    g_logp, g_ent = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)

    logp, ent = chunked_token_scores(
        hidden, weight, targets, temperature=temperature, need_entropy=True, chunk_tokens=8
    )
    assert ent is not None and logp.dtype == torch.float32
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    assert hidden.grad is not None and weight.grad is not None
    dh, dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    z = (hidden @ weight.t())[None]  # the plain path: full logits, FP32 log-softmax
    ref_logp = token_logprobs(z, targets[None], temperature)[0]
    ref_ent = entropy_from_logits(z, temperature)[0]
    ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh, hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, weight.grad, rtol=1e-5, atol=1e-5)


def test_entropy_of_peaked_rows_keeps_its_digits() -> None:
    # Large logits: lse - E[z] cancels to ~1e-5 absolute error; -sum p log p keeps FP32 relative accuracy.
    torch.manual_seed(1)
    hidden, weight = torch.randn(64, 16) * 4, torch.randn(50, 16)
    _, ent = chunked_token_scores(hidden, weight, torch.zeros(64, dtype=torch.long), need_entropy=True)
    z = (hidden @ weight.t()).double()  # the same FP32 logits, the entropy in float64
    ref = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    assert ent is not None
    torch.testing.assert_close(ent.double(), ref, rtol=1e-4, atol=1e-6)


def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


def ragged_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three right-padded rows of 9, 4 and 7 tokens; the selection skips prompts and one padding slot."""
    lengths = [9, 4, 7]
    ids = torch.randint(0, 61, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(3, 9, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids * mask  # pad id 0
    select = mask.clone()
    select[:, :2] = 0  # a two-token prompt
    return ids, mask, select


def _counts(mask: torch.Tensor, select: torch.Tensor) -> dict[str, object]:
    """What the trainer takes from ``TokenBatch.counts``: each row's length and the scored positions' count."""
    sel = (select > 0) & (mask > 0)
    # mask_free: padded rows without an attention mask, as on a GPU (the default keeps it on CPU)
    return {"lengths": mask.sum(1).tolist(), "num_selected": int(sel[:, 1:].sum()), "mask_free": True}


def _score(  # type: ignore[no-untyped-def]
    model: Qwen2ForCausalLM,
    ids,
    mask,
    select,
    packed: bool,
    need_entropy: bool,
    t: float = 0.9,
    known: dict[str, object] | None = None,
):
    """``known``: the host's counts (``_counts``), as the trainer passes them."""
    return score_tokens(
        model,
        ids,
        mask,
        select,
        temperature=t,
        need_entropy=need_entropy,
        compute_dtype=torch.float32,
        packed=packed,
        autocast=contextlib.nullcontext,
        chunk_tokens=5,
        **(known or {}),  # type: ignore[arg-type]
    )


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_model_scores_and_gradients_equal_the_logits_path(packed: bool, counted: bool) -> None:
    """Also with the host's counts (``counted``), where padded rows run without an attention mask: the
    reference below (the model with its mask) is what they must equal."""
    model = tiny_model()
    ids, mask, select = ragged_batch()
    sel = (select > 0) & (mask > 0)
    sel[:, 0] = False
    known = _counts(mask, select) if counted else None
    scores = _score(model, ids, mask, select, packed=packed, need_entropy=True, known=known)
    assert scores.entropy_BL is not None
    loss = -(scores.logprobs_BL.sum() + 0.1 * scores.entropy_BL.sum())
    loss.backward()
    fused = _grads(model)

    logits = model(input_ids=ids, attention_mask=mask).logits
    ref = scores_from_logits(logits, ids, 0.9, need_entropy=True)
    assert ref.entropy_BL is not None
    ref_logp, ref_ent = ref.logprobs_BL * sel, ref.entropy_BL * sel
    (-(ref_logp.sum() + 0.1 * ref_ent.sum())).backward()
    plain = _grads(model)

    # Unselected positions (prompt, padding, position 0) hold exactly 0.
    assert torch.all(scores.logprobs_BL[~sel] == 0) and torch.all(scores.entropy_BL[~sel] == 0)
    torch.testing.assert_close(scores.logprobs_BL, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores.entropy_BL, ref_ent, rtol=1e-5, atol=1e-5)
    assert fused.keys() == plain.keys() and "model.embed_tokens.weight" in fused  # tied lm_head: one grad
    for name, grad in fused.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-4, atol=1e-5, msg=name)
    # The lm_head forward is restored afterwards.
    assert model(input_ids=ids[:1, :3]).logits.shape == (1, 3, 61)


def test_packed_rows_never_attend_across_sequences() -> None:
    # A sequence scores the same alone and packed behind another one: nothing leaks between them.
    model = tiny_model()
    ids, mask, select = ragged_batch()
    with torch.no_grad():
        packed = _score(model, ids, mask, select, packed=True, need_entropy=False).logprobs_BL
        alone = _score(model, ids[1:2, :4], mask[1:2, :4], select[1:2, :4], packed=False, need_entropy=False)
    torch.testing.assert_close(packed[1, :4], alone.logprobs_BL[0], rtol=1e-5, atol=1e-6)
    assert torch.all(packed[1, 4:] == 0)


def test_packed_token_budget_sums_real_tokens() -> None:
    from infir2_rl.trainers.microbatch import micro_batches, packed_token_budget
    from infir2_rl.types import TokenBatch

    assert packed_token_budget([5, 3, 2, 6, 1], 8) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="max_tokens_per_gpu=4"):
        packed_token_budget([3, 5], 4)
    ids, mask, select = ragged_batch()  # lengths 9, 4, 7
    batch = TokenBatch(input_ids=ids, attention_mask=mask, loss_mask=select.float())
    packed = micro_batches(batch, 8, max_tokens_per_gpu=13, packed=True)
    padded = micro_batches(batch, 8, max_tokens_per_gpu=13)
    assert [b.num_sequences for b in packed] == [2, 1]  # 9 + 4 real tokens fit 13; padded 2 x 9 would not
    assert [b.num_sequences for b in padded] == [1, 1, 1]


VARLEN_CALLS: list[tuple[list[int], int]] = []  # (offsets, max length) of each reference_varlen call


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), scale=None):  # type: ignore[no-untyped-def]
    """A per-sequence SDPA standing in for torch's varlen_attn (CPU has no flash kernel)."""
    assert window_size == (-1, 0) and k.shape[1] == q.shape[1]  # causal, KV heads repeated
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    assert cu_k is cu_q and max_k == max_q and int(cu_q[-1]) == q.shape[0]
    VARLEN_CALLS.append((cu_q.tolist(), max_q))
    outs = []
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        assert e - s <= max_q
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
    return torch.cat([o.transpose(0, 1) for o in outs])


def _use_reference_varlen(monkeypatch: pytest.MonkeyPatch) -> None:
    from infir2_rl.trainers.torch import varlen_attention as va

    monkeypatch.setattr(va, "_varlen_fn", lambda: (reference_varlen, True, False))
    monkeypatch.setattr("infir2_rl.trainers.torch.scoring.varlen_available", lambda device: va._register())


def test_varlen_attention_plumbing_equals_the_masked_packed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU has no flash kernel: stand in a per-sequence SDPA for torch's varlen_attn and check that the
    # attention switch, the cu_seq arguments, GQA and the output layout give the masked packed path's scores.
    model = tiny_model()
    ids, mask, select = ragged_batch()
    # Under BF16 autocast, as on a GPU: SDPA casts q/k/v to BF16 and so must the varlen path (flash is
    # BF16/FP16 only); the stand-in asserts it sees BF16.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        masked = _score(model, ids, mask, select, packed=True, need_entropy=False).logprobs_BL
        _use_reference_varlen(monkeypatch)
        varlen = _score(model, ids, mask, select, packed=True, need_entropy=False).logprobs_BL
    assert model.config._attn_implementation == "sdpa"  # switched back
    torch.testing.assert_close(varlen, masked, rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="BF16/FP16"):  # FP32 outside autocast: a clear error
        _score(model, ids, mask, select, packed=True, need_entropy=False)


def test_varlen_kwargs_padded_to_a_length_keep_their_shapes_and_the_real_sequences() -> None:
    from infir2_rl.trainers.torch.varlen_attention import sequence_slots, varlen_kwargs

    assert [sequence_slots(n) for n in (1, 16, 17, 33)] == [16, 16, 32, 64]
    plain = varlen_kwargs(torch.tensor([9, 4, 7]))
    assert plain["cu_seq_lens_q"].tolist() == [0, 9, 13, 20] and plain["max_length_q"] == 9
    padded = varlen_kwargs(torch.tensor([9, 4, 7]), padded_to=32)
    # The real sequences, then the 12 pads as one sequence, then empty ones up to 16 slots.
    assert padded["cu_seq_lens_q"].tolist() == [0, 9, 13, 20, 32] + [32] * 12
    assert padded["cu_seq_lens_q"].dtype == torch.int32 and padded["cu_seq_lens_k"] is padded["cu_seq_lens_q"]
    assert padded["max_length_q"] == padded["max_length_k"] == 32
    exact = varlen_kwargs(torch.tensor([9, 4, 7]), padded_to=20)  # nothing to pad: no pad sequence
    assert exact["cu_seq_lens_q"].tolist() == [0, 9, 13, 20] + [20] * 13
    with pytest.raises(ValueError, match="20 real tokens > padded_to=19"):
        varlen_kwargs(torch.tensor([9, 4, 7]), padded_to=19)
    # A long row of short sequences: the launch bound is an eighth of the row (rounded up to 128) when every
    # sequence fits in it, and the pads are cut into sequences no longer than it; else the row's length.
    short = varlen_kwargs(torch.tensor([300] * 10), padded_to=4096)
    assert short["max_length_q"] == 512
    assert short["cu_seq_lens_q"].tolist() == [300 * i for i in range(11)] + [3512, 4024, 4096] + [4096] * 3
    assert varlen_kwargs(torch.tensor([600, 300]), padded_to=4096)["max_length_q"] == 4096
    assert varlen_kwargs(torch.tensor([300] * 30), padded_to=10240)["max_length_q"] == 1280


@pytest.mark.parametrize("varlen", [False, True])
def test_a_packed_row_padded_for_the_layer_graphs_scores_as_the_unpadded_one(
    monkeypatch: pytest.MonkeyPatch, varlen: bool
) -> None:
    # The trainer's layer graphs pad a packed row to a few lengths (packed_length); the pads are a sequence
    # of their own, so the real tokens' scores and gradients are those of the unpadded row.
    model = tiny_model()
    ids, mask, select = ragged_batch()  # 20 real tokens
    if varlen:
        _use_reference_varlen(monkeypatch)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if varlen else contextlib.nullcontext()
    results = []
    for packed_length in (None, lambda n: n + 13):
        VARLEN_CALLS.clear()
        with context:
            scores = score_tokens(
                model, ids, mask, select, temperature=0.9, need_entropy=True, compute_dtype=torch.float32,
                packed=True, autocast=contextlib.nullcontext, chunk_tokens=5, packed_length=packed_length,
            )  # fmt: skip
            assert scores.entropy_BL is not None
            (scores.logprobs_BL.sum() + 0.1 * scores.entropy_BL.sum()).backward()
        results.append((scores.logprobs_BL.detach(), scores.entropy_BL.detach(), _grads(model)))
        if varlen:  # every layer got the padded offsets: 33 tokens, 16 slots
            assert len(VARLEN_CALLS) == 2
            assert VARLEN_CALLS[0] == (
                ([0, 9, 13, 20, 33] + [33] * 12, 33) if packed_length else ([0, 9, 13, 20], 9)
            )
    (logp, ent, grads), (logp_p, ent_p, grads_p) = results
    tol = {"rtol": 1e-2, "atol": 1e-2} if varlen else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(logp_p, logp, **tol)
    torch.testing.assert_close(ent_p, ent, **tol)
    assert grads_p.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_p[name], grad, **tol, msg=name)


def test_fused_token_scores_refuse_a_device_without_triton_kernels() -> None:
    h, w = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="fused token scores need a CUDA device"):
        chunked_token_scores(h, w, torch.zeros(4, dtype=torch.long), fused=True)


@pytest.mark.parametrize("packed", [False, True])
def test_scoring_finds_its_positions_once(packed: bool) -> None:
    """On a GPU every data-dependent count (``nonzero``, also inside a boolean index) waits for the device,
    and the GPU then idles while the host catches up. A micro-batch's forward and backward find the scored
    positions once (and, packed, the real tokens once); boolean indexing did it per use: 5 times padded, 10
    packed. Counted on CPU, where the same aten ops run (the GPU's varlen attention adds its own wait for the
    sequence lengths)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = str(func)
            masks = args[1] if name.startswith(("aten.index.", "aten.index_put")) and len(args) > 1 else ()
            if "nonzero" in name or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in masks):
                calls.append(name)  # (a boolean index runs a nonzero inside the op)
            return func(*args, **(kwargs or {}))

    model = tiny_model()
    ids, mask, select = ragged_batch()
    with Count():
        scores = _score(model, ids, mask, select, packed=packed, need_entropy=False)
        scores.logprobs_BL.sum().backward()
    assert len(calls) == (2 if packed else 1), calls


def _waits_for_the_device(func: object, args: tuple) -> bool:  # type: ignore[type-arg]
    """Whether an aten call makes the host wait for a GPU: a count (``nonzero``, a boolean index) or a
    scalar read (``.item()``, ``bool(t)``). ``nonzero_static`` does not wait (its size is given)."""
    name = str(func)
    if "nonzero_static" in name:
        return False
    masks = args[1] if name.startswith(("aten.index.", "aten.index_put")) and len(args) > 1 else ()
    return (
        "nonzero" in name
        or "_local_scalar_dense" in name
        or "is_nonzero" in name
        or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in masks)
    )


def test_scoring_with_the_hosts_counts_never_waits() -> None:
    """Padded rows with ``lengths`` and ``num_selected`` (the trainer's ``TokenBatch.counts``): no count and
    no scalar read in forward or backward, transformers' mask builder included (it read whether the mask
    could be dropped). Packed rows are left out: on CPU transformers finds the packed sequences from the
    position ids itself (a GPU runs varlen attention instead, whose offsets come from ``lengths``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if _waits_for_the_device(func, args):
                calls.append(str(func))
            return func(*args, **(kwargs or {}))

    model = tiny_model()
    ids, mask, select = ragged_batch()
    with Count():
        uncounted = _score(model, ids, mask, select, packed=False, need_entropy=False)
    assert calls, "the check finds the waits of the path without counts"
    calls.clear()
    known = _counts(mask, select)  # (counted here, outside the check: the trainer counts the CPU batch)
    with Count():
        scores = _score(model, ids, mask, select, packed=False, need_entropy=False, known=known)
        scores.logprobs_BL.sum().backward()
    assert calls == []
    torch.testing.assert_close(scores.logprobs_BL, uncounted.logprobs_BL, rtol=1e-5, atol=1e-6)


def test_on_cpu_the_counts_keep_the_mask_and_every_bit() -> None:
    """Without ``mask_free`` the mask is dropped only on CUDA: on CPU nothing waits anyway, and the scores with
    the host's counts equal those without to the last bit (the CPU demo's outcome swings with last bits)."""
    model = tiny_model()
    ids, mask, select = ragged_batch()
    seen: list[object] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    known = _counts(mask, select)
    with torch.no_grad():
        plain = _score(model, ids, mask, select, packed=False, need_entropy=True)
        free = _score(model, ids, mask, select, packed=False, need_entropy=True, known=known)
        del known["mask_free"]
        counted = _score(model, ids, mask, select, packed=False, need_entropy=True, known=known)
    # What the model was given: the mask, the mask-free mapping (mask_free=True), the mask again (CPU default).
    assert seen[0] is mask and seen[1] == {"full_attention": None} and seen[2] is mask
    assert free.entropy_BL is not None and plain.entropy_BL is not None and counted.entropy_BL is not None
    assert torch.equal(plain.logprobs_BL, counted.logprobs_BL)
    assert torch.equal(plain.entropy_BL, counted.entropy_BL)


def test_a_weights_gradient_target_is_checked_and_named_by_its_caller() -> None:
    """``fp8.ops.gradient_target``, shared by the FP8 wgrad and the token scores' lm_head dW: the FP32 tensor a
    weight's ``WGRAD_INTO`` names, None without one, and one ValueError naming the caller for a wrong one."""
    from infir2_rl.fp8.ops import WGRAD_INTO, gradient_target

    w = torch.zeros(4, 3)
    assert gradient_target(w, "x") is None
    target = torch.zeros(4, 3)
    setattr(w, WGRAD_INTO, lambda _: target)
    assert gradient_target(w, "x") is target
    setattr(w, WGRAD_INTO, lambda _: None)
    assert gradient_target(w, "x") is None
    for bad in (torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(3, 4), torch.zeros(3, 4).t()):
        setattr(w, WGRAD_INTO, lambda _, b=bad: b)
        with pytest.raises(ValueError, match="chunked_token_scores: a weight's gradient target must be FP32"):
            gradient_target(w, "chunked_token_scores")
