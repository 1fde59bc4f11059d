"""SGLang backend: only the request/response translation (the server cannot run here; see the module docstring)."""

import importlib.util

import pytest
import torch

from infir2_rl.engines.sampling import row_key
from infir2_rl.engines.sglang.engine import (
    SglangEngine,
    generate_payload,
    launch_command,
    parse_generate_response,
    update_tensor_payload,
)
from infir2_rl.types import GenerateRequest, SamplingParams, WeightBucket


def _request(**params: object) -> GenerateRequest:
    return GenerateRequest("q7", [1, 2, 3], n=2, params=SamplingParams(**params), seed=11)  # type: ignore[arg-type]


def test_generate_payload_sends_n_seeded_copies_with_logprobs() -> None:
    body = generate_payload(_request(temperature=1.1, max_new_tokens=16, stop_token_ids=[9]))
    assert body["input_ids"] == [[1, 2, 3], [1, 2, 3]] and body["return_logprob"] is True
    assert body["rid"] == ["q7-0", "q7-1"]
    first = body["sampling_params"][0]
    assert first["temperature"] == 1.1 and first["max_new_tokens"] == 16 and first["stop_token_ids"] == [9]
    assert first["top_p"] == 1.0 and first["top_k"] == -1 and first["no_stop_trim"] is True
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [row_key(11, 0), row_key(11, 1)]
    assert (
        generate_payload(_request(greedy=True, temperature=0.7))["sampling_params"][0]["temperature"] == 0.0
    )


def test_generate_response_becomes_samples() -> None:
    outputs = [
        {
            "text": "ab",
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": 9},
                "output_token_logprobs": [[-0.5, 4, None], [-0.25, 9, None]],
            },
        },
        {
            "text": "c",
            "meta_info": {
                "finish_reason": {"type": "length", "length": 1},
                "output_token_logprobs": [[-1.5, 5, None]],
            },
        },
    ]
    samples = parse_generate_response(_request(), outputs)
    assert [(s.index, s.response_ids, s.logprobs, s.finish_reason) for s in samples] == [
        (0, [4, 9], [-0.5, -0.25], "stop"),
        (1, [5], [-1.5], "length"),
    ]
    assert samples[0].prompt_ids == [1, 2, 3] and samples[0].request_id == "q7"
    with pytest.raises(ValueError, match="outputs"):
        parse_generate_response(_request(), outputs[:1])
    bad = [{"meta_info": {"finish_reason": None, "output_token_logprobs": []}}]
    with pytest.raises(ValueError, match="finish_reason"):
        parse_generate_response(GenerateRequest("x", [1], n=1, params=SamplingParams()), bad)


def test_update_payload_serializes_once_per_tp_rank_and_flushes_on_the_last_bucket() -> None:
    bucket = WeightBucket(4, 1, 2, ["a.weight"], [torch.ones(2)])
    seen = []
    body = update_tensor_payload(bucket, 2, lambda named: seen.append(named) or "blob")
    assert body == {"serialized_named_tensors": ["blob", "blob"], "flush_cache": True, "weight_version": "4"}
    assert seen[0][0][0] == "a.weight"
    first = WeightBucket(4, 0, 2, ["b"], [torch.ones(1)])
    assert update_tensor_payload(first, 1, lambda named: "x")["flush_cache"] is False


def test_launch_command_and_missing_sglang() -> None:
    cmd = launch_command("/ckpt/fp8", 4, 30001, memory_saver=True)
    assert cmd[1:] == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt/fp8",
        "--tp",
        "4",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--enable-memory-saver",
    ]
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(RuntimeError, match="SGLang is not installed"):
            SglangEngine("/nowhere", fp8=True)
