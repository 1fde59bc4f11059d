"""Ray actors and their plumbing: trainer workers and group, rollout engine actors, placement (one plan for both
roles), Ray start-up (``ray_runtime.py``) and the fan-out helper that calls many actors at once (``remote.py``)."""
