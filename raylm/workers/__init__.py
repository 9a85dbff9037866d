"""What runs on each Ray Train worker: the training loop (``loop``), the step, the optimizer,
checkpoints, the per-sample ledger, the preemption vote, metrics and energy, and the faults
that end a run instead of restarting it.

The driver and the controller (``raylm.run``) import from here; nothing here imports them.
"""
