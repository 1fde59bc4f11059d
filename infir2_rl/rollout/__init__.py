"""The rollout manager: prompts to GRPO groups through the engines, dynamic sampling, token batches for the trainer."""
