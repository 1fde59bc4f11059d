"""The SGLang rollout engine backend: one SGLang server per engine actor, driven over its HTTP API."""
