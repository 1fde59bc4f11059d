"""The torch trainer backend: an HF transformers model, FP8 by swapping decoder linears, FSDP2 over ranks."""
