"""Running experiments: the training loop (``experiment``), sweeps and
trials (``sweep``), checkpoints (``checkpointing``), run identities
(``run_identity``), outputs (``reporting``), the paper's time model
(``timing``), several processes (``distributed``), the reproduce scripts'
shared parts (``reproduce``) and the command line (``experiment_entry``).
"""

__all__ = []
