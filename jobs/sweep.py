"""Sweep learning-rate schedules with Ray Tune; every trial is a full raylm training run.

Locally (starts a Ray instance for the sweep):

    python jobs/sweep.py --config jobs/configs/cpu_tiny.yaml --train.eval_every=10 \
        --tune.num_samples=4

Against a cluster (the job server sets RAY_ADDRESS, so the same file runs unchanged):

    ray job submit --working-dir . -- \
        python jobs/sweep.py --config jobs/configs/gpu_125m.yaml --run.name=sweep-125m \
            --train.steps=1000 --train.eval_every=250 --tune.num_samples=8

Writes RUN_DIR/tune_summary.json, best.yaml (the best trial's config, ready to train) and
val_loss.png. Running it again with the same run.name resumes an interrupted sweep.
"""

import sys
from pathlib import Path

# The project root first: a job submitted with --working-dir . runs the raylm it shipped, not
# an older one installed on the cluster.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raylm.cli import run  # noqa: E402

if __name__ == "__main__":
    run(["tune", *sys.argv[1:]])
