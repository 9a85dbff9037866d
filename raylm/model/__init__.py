"""The model: built from a preset or a Hugging Face directory on the meta device, adapted
(LoRA, QLoRA), attention chosen, and laid out over ranks (FSDP2, tensor and pipeline
parallelism).

Runs on the driver (a meta-device model for the checks before Ray starts) and on Ray Train
workers (the real one). It knows nothing of runs, checkpoints or Ray.
"""
