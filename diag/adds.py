"""One-off: which BF16 adds of an FP8 (and BF16) trainer step run on non-contiguous operands, and from where."""
import sys, traceback
from collections import Counter
from pathlib import Path
import torch
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_step import model_dir, sft_batch  # noqa

class Log(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.c = Counter(); self.where = Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "add" in name and func.__name__ not in ("addmm",):
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            if ts and ts[0].numel() > 100000:
                key = (name, tuple(tuple(t.shape) for t in ts), tuple(t.stride() for t in ts), tuple(str(t.dtype) for t in ts), tuple(t.is_contiguous() for t in ts))
                self.c[key] += 1
                st = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1] if "infir2_rl" in f.filename or "transformers" in f.filename][-3:]
                self.where[(key, tuple(st))] += 1
        return func(*args, **(kwargs or {}))

def main():
    from transformers import AutoConfig
    from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
    from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens
    from infir2_rl.trainers.torch.trainer import TorchTrainer
    dev = torch.device("cuda")
    path = model_dir(False)
    cfg = AutoConfig.from_pretrained(path)
    batch = sft_batch(1, 8192, cfg.vocab_size)
    for fp8 in (True, False):
        for graphs in (False,):
            tr = TorchTrainer(ModelConfig(path=str(path)), TrainerConfig(cuda_graphs=graphs),
                              OptimizerConfig(lr=1e-5, min_lr=0.0, schedule="constant", warmup_ratio=0.0),
                              fp8=fp8, total_steps=5, device=dev)
            units = num_target_tokens(batch)
            tr.train_step([batch], SftLossFn(), units)
            torch.cuda.synchronize()
            m = Log()
            with m:
                tr.train_step([batch], SftLossFn(), units)
            torch.cuda.synchronize()
            print(f"=== fp8={fp8} graphs={graphs}")
            for (key, st), n in sorted(m.where.items(), key=lambda kv: -kv[1]):
                print(n, key, st)
            del tr; torch.cuda.empty_cache()

main()
