"""Trainer weights to rollout engines: FP8 export into buckets, transports (object store, CUDA IPC), versions,
the post-push self-check (``service.py``), and the engine-side loader (``receiver.py``)."""
