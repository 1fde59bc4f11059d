"""Peers and the RL-shaped workload for bench/rollout.py (imported by it; not a script).

* ``hf_step_ms``: transformers ``generate`` on the same random model, sampling at T=1.0 with top-k/top-p
  off and exactly ``new_tokens`` tokens (``min_new_tokens``), with the dynamic cache in eager mode or with
  ``cache_implementation="static"``, with which ``generate`` compiles its decoding forward itself
  (transformers' auto-compile: ``CompileConfig`` defaults, ``mode="reduce-overhead"``, i.e. CUDA graphs).
  Wrapping ``model.forward`` in ``torch.compile`` on top of that, as this script did before, fails under
  transformers 5.17 ("accessing tensor output of CUDAGraphs that has been overwritten"). ms per decode step = (median wall of the full call - median wall of a 1-token call) /
  (new_tokens - 1), as for the engines.
* ``rl_workload``: 64 prompts x 16 samples (128 random prompt tokens), T=1.0, max 2,048 new tokens, and
  a stop set of random token ids sized so that a row stops with probability ~1/``mean_len`` per step
  (the random model's next-token distribution is close to uniform): geometric response lengths with a
  long tail, capped at 2,048.
* ``hf_rl_estimate_s``: what transformers ``generate`` would take on the same workload, from its measured
  step time: it runs fixed chunks of ``chunk`` rows, each until its longest row ends, so the estimate is
  sum over chunks of (longest response in the chunk x step ms) with the engine's own response lengths
  chunked in request order. The step time is measured with a short static cache (prompt + 128), and a
  static cache of 2,176 positions makes every step slower, so the estimate favours transformers.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _hf_generate(model: Any, ids: torch.Tensor, new_tokens: int, static: bool) -> float:
    kwargs: dict[str, Any] = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )
    if static:
        kwargs["cache_implementation"] = "static"
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


def hf_step_ms(
    path: str, batches: list[int], prompt_len: int, new_tokens: int, repeats: int, static: bool
) -> dict[int, dict[str, float]]:
    """ms per decode step of transformers generate (module docstring) per batch size; errors are recorded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.cuda().eval()  # type: ignore[call-arg]  # transformers 5.23 types .cuda() as a wrapper
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    model.generation_config.eos_token_id = None
    if static:  # generate compiles the decoding forward itself (module docstring); say so if it would not
        from transformers import CompileConfig

        model.generation_config.compile_config = CompileConfig()
    out: dict[int, dict[str, float]] = {}
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).cuda()
        start = time.perf_counter()
        for n in (new_tokens, 1):  # warm-up, compiles both shapes when static
            _hf_generate(model, ids, n, static)
        warm_s = time.perf_counter() - start
        if static and not hasattr(model, "_compiled_call"):  # transformers' marker of its compiled forward
            raise RuntimeError("generate with the static cache did not compile its forward")
        full = [_hf_generate(model, ids, new_tokens, static) for _ in range(repeats)]
        first = [_hf_generate(model, ids, 1, static) for _ in range(repeats)]
        steps = [1e3 * (f - statistics.median(first)) / (new_tokens - 1) for f in full]
        out[batch] = {
            "decode_step_ms": statistics.median(steps),
            "step_ms_min": min(steps),
            "step_ms_max": max(steps),
            "tokens_per_s": batch * new_tokens / statistics.median(full),
            "warmup_s": warm_s,
        }
    del model
    torch.cuda.empty_cache()
    return out


def rl_requests(
    vocab: int,
    prompts: int,
    samples: int,
    prompt_len: int,
    max_new: int,
    mean_len: int,
    fixed_lengths: bool = False,
) -> list[Any]:
    """The RL-shaped requests. Lengths ``sampled``: a stop set of vocab / mean_len random ids, so each row's
    length follows its own sampled tokens (geometric, and different for BF16 and FP8 models). With
    ``fixed_lengths``: no stop ids, each prompt's rows run to a length drawn from the same geometric law
    (capped at ``max_new``), so every engine does exactly the same work."""
    from infir2_rl.types import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(7)
    stops = torch.randperm(vocab, generator=g)[: max(1, vocab // mean_len)].tolist()
    reqs = []
    for i in range(prompts):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        if fixed_lengths:
            u = float(torch.rand((), generator=g))
            length = min(max_new, 1 + int(math.log1p(-u) / math.log1p(-1.0 / mean_len)))
            params = SamplingParams(temperature=1.0, max_new_tokens=length)
        else:
            params = SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=stops)
        reqs.append(GenerateRequest(f"p{i}", prompt, samples, params, seed=i))
    return reqs


def rl_workload(engine: Any, reqs: list[Any], repeats: int) -> dict[str, Any]:
    """Wall time and tokens/s of ``engine.generate`` on the RL-shaped requests (median, min, max)."""
    walls, lengths = [], []
    scheduler = getattr(engine, "_scheduler", None)
    for _ in range(repeats):
        if scheduler is not None:  # the work tally of the last call (scheduler.py)
            scheduler.tally.clear()
            scheduler.steps_by_size.clear()
        _sync()
        start = time.perf_counter()
        samples = engine.generate(reqs)
        _sync()
        walls.append(time.perf_counter() - start)
        lengths = [len(s.response_ids) for s in samples]
    tokens = sum(lengths)
    return {
        "wall_s": {"median": statistics.median(walls), "min": min(walls), "max": max(walls)},
        "tokens": tokens,
        "tokens_per_s": tokens / statistics.median(walls),
        "response_len": {
            "mean": tokens / len(lengths),
            "median": statistics.median(lengths),
            "max": max(lengths),
            "at_max": lengths.count(max(r.params.max_new_tokens for r in reqs)),
        },
        "lengths": lengths,
        "work": None
        if scheduler is None
        else dict(scheduler.tally) | {"decode_steps_by_batch": dict(sorted(scheduler.steps_by_size.items()))},
    }


def hf_rl_estimate_s(lengths: list[int], chunk: int, step_ms: float, prefill_s: float) -> float:
    chunks = [lengths[i : i + chunk] for i in range(0, len(lengths), chunk)]
    return sum(max(c) * step_ms / 1e3 + prefill_s for c in chunks)
