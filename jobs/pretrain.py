"""Train a language model on a Ray cluster (prepares the data first when needed).

Locally (starts a Ray instance for the run):

    python jobs/pretrain.py --config jobs/configs/cpu_tiny.yaml

Against a cluster (the job server sets RAY_ADDRESS, so the same file runs unchanged):

    ray job submit --working-dir . -- python jobs/pretrain.py --config jobs/configs/cpu_tiny.yaml

Any config key can be overridden as --section.key=value. Running it again with the same
run.name and run.storage_path resumes from the run's latest checkpoint.
"""

import sys
from pathlib import Path

# The project root first: a job submitted with --working-dir . runs the raylm it shipped, not
# an older one installed on the cluster.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raylm.cli import run  # noqa: E402

if __name__ == "__main__":
    run(["train", *sys.argv[1:]])
