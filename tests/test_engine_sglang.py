"""SGLang backend without SGLang: request bodies, reply parsing, and the engine's call sequences against a fake
HTTP server that answers as SGLang 0.5.15.post1 does (bodies and status codes from its http_server.py). What
SGLang itself accepts is tested in test_sglang_contract.py."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from infir2_rl.engines.sglang import protocol as P
from infir2_rl.engines.sglang.engine import SglangEngine
from infir2_rl.fp8.cast_checks import is_blockwise_fp8
from infir2_rl.types import GenerateRequest, SamplingParams, WeightBucket


def _request(rid: str = "q7", prompt: list[int] | None = None, **params: Any) -> GenerateRequest:
    return GenerateRequest(rid, prompt or [1, 2, 3], n=2, params=SamplingParams(**params), seed=11)


def _output(tokens: list[int], kind: str = "length") -> dict[str, Any]:
    pairs = [[-0.5, t, None] for t in tokens]
    return {"text": "", "meta_info": {"finish_reason": {"type": kind}, "output_token_logprobs": pairs}}


class FakeSglang:
    """Records (method, path, body) and answers like SGLang; ``replies[path] = (status, body)`` overrides."""

    def __init__(self, tp: int = 1) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.replies: dict[str, tuple[int, Any]] = {}
        self.checksums = iter(f"sum{i}" for i in range(100))
        self.tp = tp
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length).decode() if length else ""
                body = json.loads(raw) if raw else None
                fake.calls.append((method, self.path, body))
                status, reply = fake.reply(self.path.split("?")[0], body)
                data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def reply(self, path: str, body: Any) -> tuple[int, Any]:
        if path in self.replies:
            return self.replies[path]
        if path == "/generate":
            return 200, [_output([5, 6]) for _ in body["input_ids"]]
        if path.startswith("/update_weights") or path == "/init_weights_update_group":
            return 200, {"success": True, "message": "Success"}
        if path == "/weights_checker":
            checksum = next(self.checksums)
            return 200, {
                "success": True,
                "message": "Success.",
                "ranks": [{}] * self.tp,
                "per_engine_checksum": checksum,
            }
        if path == "/flush_cache":
            return 200, "Cache flushed.\n"
        if path in ("/pause_generation", "/continue_generation"):
            return 200, {"message": "ok", "status": "ok"}
        return 200, None

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.calls]

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture
def fake() -> Any:
    server = FakeSglang()
    yield server
    server.close()


def _engine(server: FakeSglang, colocated: bool = True, context_length: int = 64) -> SglangEngine:
    engine = SglangEngine(
        server, fp8=True, colocated=colocated, context_length=context_length, tensor_parallel_size=server.tp
    )
    engine._serialize_per_rank = lambda bucket: ["blob"] * engine.tp  # type: ignore[method-assign]
    return engine


def test_launch_command_passes_the_engine_share_gpu_and_memory_saver_only_when_colocated() -> None:
    colocated = P.launch_command(
        P.LaunchOptions("/ckpt", 30001, 2, gpu_share=0.4, base_gpu_id=3, context_length=4096)
    )
    assert colocated[1:] == [
        "-m", "sglang.launch_server", "--model-path", "/ckpt", "--tp-size", "2", "--base-gpu-id", "3",
        "--host", "127.0.0.1", "--port", "30001", "--mem-fraction-static", "0.34", "--enable-memory-saver",
        "--context-length", "4096",
    ]  # fmt: skip
    own = P.launch_command(P.LaunchOptions("/ckpt", 30001, deterministic=True, random_seed=7))
    assert "--mem-fraction-static" not in own and "--enable-memory-saver" not in own
    assert own[-3:] == ["--enable-deterministic-inference", "--random-seed", "7"]
    assert "--max-running-requests" not in own and "--dtype" not in own  # SGLang's defaults
    capped = P.launch_command(P.LaunchOptions("/ckpt", 1, max_running_requests=256, dtype="bfloat16"))
    assert capped[-4:] == ["--max-running-requests", "256", "--dtype", "bfloat16"]
    with pytest.raises(ValueError, match="gpu_share=1.5"):
        P.launch_command(P.LaunchOptions("/ckpt", 1, gpu_share=1.5))


def test_generate_payload_sends_n_seeded_copies_in_sglang_seed_range() -> None:
    body = P.generate_payload(_request(temperature=1.1, max_new_tokens=16, stop_token_ids=[9]))
    assert body["input_ids"] == [[1, 2, 3], [1, 2, 3]] and body["return_logprob"] is True
    assert body["rid"] == ["q7-0", "q7-1"]
    first = body["sampling_params"][0]
    assert first["temperature"] == 1.1 and first["max_new_tokens"] == 16 and first["stop_token_ids"] == [9]
    assert first["top_p"] == 1.0 and first["top_k"] == -1 and first["no_stop_trim"] is True
    seeds = [p["sampling_seed"] for p in body["sampling_params"]]
    assert seeds == [P.sampling_seed(11, 0), P.sampling_seed(11, 1)] and seeds[0] != seeds[1]
    many = [P.sampling_seed(s, i) for s in (0, -1, 2**40 + 3, 123456789) for i in range(64)]
    assert all(0 <= x < 2**31 for x in many) and max(many) > 2**30  # the whole range is used
    assert (
        P.generate_payload(_request(greedy=True, temperature=0.7))["sampling_params"][0]["temperature"] == 0.0
    )
    assert (
        P.generate_payload(_request(max_new_tokens=16), max_new_tokens=5)["sampling_params"][1][
            "max_new_tokens"
        ]
        == 5
    )


def test_generate_response_becomes_samples() -> None:
    outputs = [_output([4, 9], "stop"), _output([5], "length")]
    samples = P.parse_generate_response(_request(), outputs)
    assert [(s.index, s.response_ids, s.logprobs, s.finish_reason) for s in samples] == [
        (0, [4, 9], [-0.5, -0.5], "stop"),
        (1, [5], [-0.5], "length"),
    ]
    with pytest.raises(ValueError, match="outputs"):
        P.parse_generate_response(_request(), outputs[:1])
    bad = [{"meta_info": {"finish_reason": None, "output_token_logprobs": []}}]
    with pytest.raises(ValueError, match="finish_reason"):
        P.parse_generate_response(GenerateRequest("x", [1], n=1, params=SamplingParams()), bad)


def test_overlong_prompts_are_refused_per_request_and_budgets_fit_the_context(fake: FakeSglang) -> None:
    # SGLang's scheduler refuses a prompt of context - 6 tokens or more and keeps prompt + new <= context - 2
    # (test_sglang_contract.py holds these against its code).
    engine = _engine(fake, colocated=False, context_length=20)
    short, near, long = _request("a", [1] * 3), _request("b", [1] * 13), _request("c", [1] * 14)
    samples = engine.generate([short, near, long])
    sent = [body for _, path, body in fake.calls if path == "/generate"]
    assert sorted(b["rid"][0] for b in sent) == ["a-0", "b-0"]  # the long prompt never reached SGLang
    budgets = {b["rid"][0]: b["sampling_params"][0]["max_new_tokens"] for b in sent}
    assert budgets == {"a-0": min(SamplingParams().max_new_tokens, 15), "b-0": 5}
    assert [(s.request_id, s.finish_reason, s.response_ids) for s in samples[4:]] == [("c", "abort", [])] * 2
    assert [s.request_id for s in samples[:4]] == ["a", "a", "b", "b"]


def test_fp8_engines_start_only_from_an_fp8_checkpoint(tmp_path: Any) -> None:
    # From a BF16 checkpoint SGLang builds BF16 linears and casts each pushed FP8 tensor into them unscaled.
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="not a blockwise FP8 checkpoint"):
        SglangEngine.launch(str(tmp_path), fp8=True)
    assert is_blockwise_fp8({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert not is_blockwise_fp8({"quantization_config": {"quant_method": "fp8"}})


def test_sglang_error_bodies_reach_our_errors(fake: FakeSglang) -> None:
    engine = _engine(fake, colocated=False)
    fake.replies["/generate"] = (
        400,
        {"error": {"message": "The input (70 tokens) is longer than the model's"}},
    )
    with pytest.raises(P.SglangError, match=r"HTTP 400: The input \(70 tokens\)"):
        engine.generate([_request()])
    fake.replies["/update_weights_from_tensor"] = (
        400,
        {"success": False, "message": "Unknown load_format=x"},
    )
    with pytest.raises(P.SglangError, match="Unknown load_format=x"):
        engine.update_weights(WeightBucket(1, 0, 1, ["w"], [torch.ones(2)]))
    assert P.error_message(400, "Flush cache failed.\n") == "HTTP 400: Flush cache failed."


def test_colocated_handover_pauses_flushes_releases_then_resumes_weights_before_the_push(
    fake: FakeSglang,
) -> None:
    engine = _engine(fake)
    engine.release_memory()
    assert fake.calls == [
        ("POST", "/pause_generation", {"mode": "abort"}),
        ("POST", "/flush_cache?timeout=30", None),  # SGLang waits for the aborted batch to leave (up to 30 s)
        ("POST", "/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}),
    ]
    fake.calls.clear()
    engine.resume_memory()
    assert fake.calls == [("POST", "/resume_memory_occupation", {"tags": ["weights"]})]
    with pytest.raises(RuntimeError, match="released and not pushed"):
        engine.generate([_request()])
    fake.calls.clear()
    for index in range(2):
        engine.update_weights(WeightBucket(3, index, 2, [f"w{index}"], [torch.ones(2)]))
    assert fake.paths() == [
        "/update_weights_from_tensor",
        "/update_weights_from_tensor",
        "/resume_memory_occupation",
        "/weights_checker",
        "/continue_generation",
    ]
    updates = [b for _, p, b in fake.calls if p == "/update_weights_from_tensor"]
    assert [u["flush_cache"] for u in updates] == [False, True]
    assert updates[0] == {
        "serialized_named_tensors": ["blob"], "load_format": "flattened_bucket", "flush_cache": False,
        "weight_version": "3",
    }  # fmt: skip
    assert fake.calls[2][2] == {"tags": ["kv_cache", "cuda_graph"]}
    assert fake.calls[3][2] == {"action": "checksum"}
    assert engine.health().weight_version == 3
    assert len(engine.generate([_request()])) == 2


def test_disaggregated_engine_keeps_its_memory_and_pauses_only_around_pushes(fake: FakeSglang) -> None:
    engine = _engine(fake, colocated=False)
    engine.release_memory()
    engine.resume_memory()
    assert fake.calls == []
    engine.update_weights(WeightBucket(1, 0, 1, ["w"], [torch.ones(2)]))
    assert fake.paths() == [
        "/pause_generation",
        "/update_weights_from_tensor",
        "/weights_checker",
        "/continue_generation",
    ]


def test_push_check_needs_every_rank_and_warns_on_unchanged_weights(fake: FakeSglang, caplog: Any) -> None:
    fake.tp = 2
    engine = _engine(fake, colocated=False)
    fake.checksums = iter(["same", "same"])
    engine.update_weights(WeightBucket(1, 0, 1, ["w"], [torch.ones(2)]))
    with caplog.at_level(logging.WARNING):
        engine.update_weights(WeightBucket(2, 0, 1, ["w"], [torch.ones(2)]))
    assert "bit-identical" in caplog.text
    fake.replies["/weights_checker"] = (200, {"success": True, "ranks": [{}], "per_engine_checksum": "x"})
    with pytest.raises(P.SglangError, match="1 ranks of 2"):
        engine.update_weights(WeightBucket(3, 0, 1, ["w"], [torch.ones(2)]))
    with pytest.raises(NotImplementedError, match="self_check_layers=0"):
        engine.read_weights(["w"])


def test_health_generates_one_token_unless_memory_is_released(fake: FakeSglang) -> None:
    engine = _engine(fake)
    assert engine.health().ok and fake.calls[-1][:2] == ("GET", "/health_generate")
    fake.replies["/health_generate"] = (503, "")
    health = engine.health()
    assert not health.ok and "503" in health.detail
    engine.release_memory()
    fake.calls.clear()
    health = engine.health()
    assert health.ok and "memory released" in health.detail and fake.calls == []
    # Paused mid-push (a push that failed half-way, say): /health_generate would wait for the pause, then 503.
    fresh = _engine(fake)
    fresh._pause()
    fake.calls.clear()
    health = fresh.health()
    assert health.ok and "paused" in health.detail and fake.calls == []


def test_a_colocated_server_puts_its_cuda_graphs_under_the_memory_saver() -> None:
    # Without SGLANG_MEMORY_SAVER_CUDA_GRAPH SGLang keeps graph memory outside the saver: releasing the
    # cuda_graph tag freed nothing (test_sglang_contract.py checks the variable still gates it).
    def opts(share: float | None) -> P.LaunchOptions:
        return P.LaunchOptions("/m", 1, 1, share, 0, False)

    assert P.server_env(opts(0.5), {"A": "1"}) == {"A": "1", "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
    assert P.server_env(opts(None), {"A": "1"}) == {"A": "1"}


def test_nccl_requests_and_group_layout(fake: FakeSglang) -> None:
    assert P.nccl_group_layout(num_engines=3, tensor_parallel_size=2) == (7, [1, 3, 5])
    engine = _engine(fake, colocated=False)
    engine.init_weights_update_group("10.0.0.1", 29500, rank_offset=3, world_size=7)
    assert fake.calls[-1][2] == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3, "world_size": 7,
        "group_name": engine.group_name, "backend": "nccl",
    }  # fmt: skip
    metas = [(torch.float8_e4m3fn, (256, 128)), (torch.float32, (2, 1))]
    engine.update_weights_from_distributed(4, 0, 1, ["a.weight", "a.weight_scale_inv"], metas)
    body = next(b for _, p, b in fake.calls if p == "/update_weights_from_distributed")
    assert body["dtypes"] == ["float8_e4m3fn", "float32"] and body["shapes"] == [[256, 128], [2, 1]]
    assert (
        body["load_format"] == "flattened_bucket"
        and body["flush_cache"] is True
        and body["weight_version"] == "4"
    )
    assert engine.health().weight_version == 4


def test_flat_bytes_packs_tensors_back_to_back() -> None:
    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(5, dtype=torch.bfloat16)
    flat = P.flat_bytes([a, b])
    assert flat.dtype == torch.uint8 and flat.numel() == 6 * 4 + 5 * 2
    assert torch.equal(flat[:24].view(torch.float32).reshape(2, 3), a)
    payload = P.flattened_bucket(["a", "b"], [a, b], lambda **kw: kw)
    assert [(m["name"], m["start_idx"], m["end_idx"]) for m in payload["metadata"]] == [
        ("a", 0, 24),
        ("b", 24, 34),
    ]


def test_sglang_engines_need_the_byte_self_check_off_and_no_cuda_ipc_when_the_config_loads() -> None:
    """Both are refused by the stage config, before any Ray actor starts (they used to be refused only when the
    engines or the weight-sync service were created)."""
    from infir2_rl.config.loader import parse_stage_config

    sglang = {"kind": "rl", "rollout": {"backend": "sglang"}}
    with pytest.raises(ValueError, match="weight_sync.self_check_layers=2: SGLang engines cannot read back"):
        parse_stage_config(sglang)
    with pytest.raises(ValueError, match="transport=cuda_ipc needs rollout.backend=native"):
        parse_stage_config({**sglang, "weight_sync": {"self_check_layers": 0, "transport": "cuda_ipc"}})
    cfg = parse_stage_config({**sglang, "weight_sync": {"self_check_layers": 0}})
    assert cfg.rollout.backend == "sglang" and cfg.weight_sync.transport == "auto"


def test_the_sglang_backend_gets_the_batch_cap_and_dtype_and_says_what_it_cannot_honour(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """rollout.max_batch_size and model.dtype reach the server's flags ("auto": BF16, not SGLang's FP16 for an
    FP32 checkpoint); power-of-two trainer scales, which SGLang's activation quantization does not follow, are
    said in one warning."""
    from infir2_rl.actors.rollout_engine import make_engine_backend
    from infir2_rl.config.components import RolloutConfig

    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        SglangEngine, "launch", classmethod(lambda cls, path, **kw: seen.update(kw, path=path))
    )
    rollout = RolloutConfig(backend="sglang", max_batch_size=96)
    make_engine_backend(rollout, "/ckpt", fp8=True, dtype="auto", pow2_scales=False)
    assert (seen["max_running_requests"], seen["dtype"]) == (96, "bfloat16")
    assert "fp8_pow2_scales" not in caplog.text
    with caplog.at_level("WARNING"):
        make_engine_backend(rollout, "/ckpt", fp8=True, dtype="float32", pow2_scales=True)
    assert seen["dtype"] == "float32" and "trainer.fp8_pow2_scales=true" in caplog.text
