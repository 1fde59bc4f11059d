"""Throughput of the BF16 -> FP8 checkpoint cast on a generated random Qwen2-shaped checkpoint.

    python bench/cast.py [--hidden 2048] [--intermediate 5632] [--layers 8] [--shards 4]

Writes a random BF16 checkpoint (config.json + safetensors shards) into a temporary directory, then
casts it with the quantizer on the CPU and, when a GPU is present, on the GPU, and prints the wall time
and GB/s of BF16 read (including safetensors I/O, as a user sees it). The GPU and CPU outputs are
compared byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from infir2_rl.fp8.checkpoint import cast_checkpoint


def write_random_checkpoint(path: Path, hidden: int, inter: int, layers: int, shards: int, vocab: int) -> int:
    path.mkdir(parents=True)
    kv = max(hidden // 7, 128) // 128 * 128  # Qwen2.5 uses few KV heads
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        names += [
            (f"{p}.self_attn.q_proj.weight", (hidden, hidden)),
            (f"{p}.self_attn.q_proj.bias", (hidden,)),
            (f"{p}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter)),
            (f"{p}.input_layernorm.weight", (hidden,)),
        ]
    names += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    per_shard = -(-len(names) // shards)
    weight_map, total = {}, 0
    gen = torch.Generator().manual_seed(0)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {
            n: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            for n, shape in names[s * per_shard : (s + 1) * per_shard]
        }
        save_file(chunk, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
        total += sum(t.numel() * 2 for t in chunk.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "torch_dtype": "bfloat16"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return total


def digest(model_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args(argv)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bf16"
        total = write_random_checkpoint(
            src, args.hidden, args.intermediate, args.layers, args.shards, args.vocab
        )
        print(f"# random BF16 checkpoint: {total / 1e9:.2f} GB in {args.shards} shards; torch {torch.__version__}, "
              f"{torch.get_num_threads()} CPU threads{'; ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ''}")  # fmt: skip
        print(
            f"{'quantizer on':<12} {'seconds':>8} {'GB/s read':>10} {'GB out':>7} {'quantized':>9}  sha256[:16]"
        )
        digests = {}
        for dev in devices:
            if dev == "cuda":  # warm-up: Triton compiles its kernels once per process
                cast_checkpoint(src, Path(tmp) / "warm", device=dev, progress=False)
            report = cast_checkpoint(src, Path(tmp) / f"fp8_{dev}", device=dev, progress=False)
            digests[dev] = digest(Path(tmp) / f"fp8_{dev}")
            print(
                f"{dev:<12} {report.seconds:8.2f} {report.bytes_in / 1e9 / report.seconds:10.2f} "
                f"{report.bytes_out / 1e9:7.2f} {report.num_quantized:>9}  {digests[dev]}"
            )
        if len(set(digests.values())) > 1:
            print("MISMATCH: CPU and GPU casts differ")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
