"""infir2-rl: FP8 end-to-end post-training (SFT -> GRPO) for reasoning LLMs, orchestrated by Ray."""

__version__ = "0.1.0"
