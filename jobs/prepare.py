"""Tokenize and pack a corpus on a Ray cluster; write Parquet blocks and manifest.json.

Locally (starts a Ray instance for the run):

    python jobs/prepare.py --config jobs/configs/cpu_tiny.yaml --output runs/prepared

Against a cluster (the job server sets RAY_ADDRESS, so the same file runs unchanged):

    ray job submit --working-dir . -- \
        python jobs/prepare.py --config jobs/configs/cpu_tiny.yaml --output /mnt/shared/prepared

Any config key can be overridden as --section.key=value.
"""

import sys
from pathlib import Path

# The project root first: a job submitted with --working-dir . runs the raylm it shipped, not
# an older one installed on the cluster.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raylm.cli import run  # noqa: E402

if __name__ == "__main__":
    run(["prepare", *sys.argv[1:]])
