"""The stage loops: ``sft.py`` and ``rl.py`` (with ``rl_setup.py`` building the RL actors), shared helpers in ``common.py``."""
