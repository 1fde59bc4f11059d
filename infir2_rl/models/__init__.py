"""Model factory (presets from tiny to 7B shapes, built locally) and the locally built BPE tokenizer."""
