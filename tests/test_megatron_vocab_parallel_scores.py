"""The vocab-parallel token scorer (the megatron trainer's under TP) on two gloo ranks against the single-rank
``chunked_token_scores`` on the whole weight: log-probs, entropies, the hidden states' gradient (summed over the
ranks) and each rank's weight-shard gradient, with a padded vocabulary row that must count for nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infir2_rl.trainers.megatron.vocab_parallel_scores import vocab_parallel_token_scores
from infir2_rl.trainers.token_scores import chunked_token_scores

VOCAB, TP = 37, 2  # padded to 38: rank 1's last row is padding


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n, hidden = 13, 16
    h = torch.randn(n, hidden, generator=gen)
    w = torch.randn(VOCAB + 1, hidden, generator=gen)
    w[VOCAB] = 50.0  # a padded row that would dominate every softmax if it were not masked
    targets = torch.randint(0, VOCAB, (n,), generator=gen)
    targets[:2] = torch.tensor([0, VOCAB - 1])  # one target in each shard at least
    weights = torch.rand(n, 2, generator=gen) + 0.5
    return h, w, targets, weights


def _rank(rank: int, init_file: str, need_entropy: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    try:
        h, w, targets, weights = _inputs()
        rows = w.shape[0] // TP
        # The reference: one rank, the unpadded weight.
        h_ref, w_ref = h.clone().requires_grad_(), w[:VOCAB].clone().requires_grad_()
        logp_ref, ent_ref = chunked_token_scores(
            h_ref, w_ref, targets, temperature=0.7, need_entropy=need_entropy, chunk_tokens=5
        )
        loss_ref = (logp_ref * weights[:, 0]).sum() + (
            (ent_ref * weights[:, 1]).sum() if ent_ref is not None else 0.0
        )
        loss_ref.backward()
        # This rank's shard.
        h_r, w_r = h.clone().requires_grad_(), w[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        logp, ent = vocab_parallel_token_scores(
            h_r, w_r, targets, vocab_start=rank * rows, vocab_size=VOCAB, group=dist.group.WORLD,
            temperature=0.7, need_entropy=need_entropy, chunk_tokens=5,
        )  # fmt: skip
        loss = (logp * weights[:, 0]).sum() + ((ent * weights[:, 1]).sum() if ent is not None else 0.0)
        loss.backward()
        torch.testing.assert_close(logp, logp_ref, rtol=0, atol=1e-5)
        if need_entropy:
            assert ent is not None and ent_ref is not None
            torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-5)
        else:
            assert ent is None
        assert h_r.grad is not None and w_r.grad is not None and w_ref.grad is not None
        torch.testing.assert_close(h_r.grad, h_ref.grad, rtol=1e-5, atol=1e-5)
        expected_w = torch.cat([w_ref.grad, torch.zeros(1, w.shape[1])])[rank * rows : (rank + 1) * rows]
        torch.testing.assert_close(w_r.grad, expected_w, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("need_entropy", [False, True])
def test_two_ranks_equal_one_rank_on_the_whole_weight(tmp_path: Path, need_entropy: bool) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "init"), need_entropy), nprocs=TP, join=True)
