"""Rollout engine backends, implementing `infir2_rl.types.EngineBackend`.

``native/`` is the embedded engine (eager on CPU); ``sglang/`` drives SGLang servers. ``sampling.py`` holds the
sampling rule (per-row seeds, tempered log-probs) both follow.
"""
