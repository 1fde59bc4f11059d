"""Trainer backends: one data-parallel rank each, implementing `infir2_rl.types.TrainerBackend`.

``torch/`` trains an HF transformers model (FSDP2 over several ranks); ``megatron/`` a megatron-core GPTModel.
``optim.py`` and ``microbatch.py`` are shared by both.
"""
