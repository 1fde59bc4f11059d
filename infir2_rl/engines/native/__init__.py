"""The native rollout engine: W8A8 blockwise FP8 generation from the trainer's own bytes, per-token log-probs."""
