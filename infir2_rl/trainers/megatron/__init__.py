"""megatron-core trainer backend (``trainer.backend=megatron``); see trainer.py. Imports megatron lazily."""
