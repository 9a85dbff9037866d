#!/usr/bin/env bash
# Rehearse a GPU machine's first command on this machine, on CPU (not part of CI; ~10 minutes
# here, plus ~4 GB of downloads the first time).
#
#   bash scripts/gpu_rehearse.sh [WORK_DIR]      # default build/rehearsal
#
# 1. A fresh Python 3.12 virtual environment (PY312, default python3.12) holding the GPU image's
#    versions of the packages raylm imports and nothing else (torch 2.11.0 as PyPI serves it,
#    which runs on CPU; the versions below were read off an H100 machine's image).
# 2. The wheel set (scripts/gpu_wheels.py) installed offline, without dependency resolution,
#    by scripts/gpu_run.sh exactly as on the GPU machine; Ray started by it.
# 3. Through it: `raylm train` (tiny, 2 workers, 10 steps with checkpoints, then on to 20 as a
#    resume), a LoRA chat run from a saved model, DPO as a full fine-tune of that model (its
#    reference pass first), a 2-trial `raylm tune`, and
#    `python -m raylm.bench mfu --help`. Each command's output is in WORK_DIR/out/N.log.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-build/rehearsal}
PY312=${PY312:-python3.12}
MARK=.raylm-rehearsal
if [ -e "$WORK" ] && [ ! -e "$WORK/$MARK" ]; then
    echo "gpu_rehearse: $WORK exists and was not made by this script; name another folder" >&2
    exit 2
fi
mkdir -p "$WORK"
touch "$WORK/$MARK"
WORK=$(cd "$WORK" && pwd)
# The GPU image's versions (python3 -m pip list there, 2026-11-24); pyyaml, requests, click,
# filelock, fsspec, tqdm and matplotlib are there too, at versions that do not matter here.
IMAGE=(torch==2.11.0 transformers==5.17.0 peft==0.21.0 numpy==2.5.2 pyarrow==25.0.1
       pandas==3.0.6 grpcio==1.84.0 protobuf==7.36.2 msgpack==1.2.3 aiohttp==3.14.3
       psutil==7.2.2 tokenizers==0.23.2 safetensors==0.8.0 packaging==26.3
       typing_extensions==4.16.0 nvidia-ml-py==13.610.43 pyyaml requests click filelock
       fsspec tqdm matplotlib)
if [ ! -x "$WORK/venv/bin/python" ]; then
    "$PY312" -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install --quiet --disable-pip-version-check "${IMAGE[@]}"
fi
python3 scripts/gpu_wheels.py --output "$WORK/wheels"
# Everything this script wrote before: runs, data, Ray's site.
rm -rf "$WORK/out" "$WORK/runs" "$WORK/data" "$WORK/site"
# The runs share a cache and storage in WORK; no MLflow (not in the set) and no bf16 on CPU.
COMMON="--run.storage_path=$WORK/runs --run.cache_dir=$WORK/cache --tracking.enabled=false"
TINY="python -m raylm train --config jobs/configs/cpu_tiny.yaml $COMMON \
--data.builtin_packages=[peft,transformers] --scaling.num_workers=2 --checkpoint.every=5 \
--train.log_every=5"
LORA="python -m raylm.examples.reverse_words write --output $WORK/data --train 400 --heldout 20 --pretrain 200 \
&& python -m raylm.examples.reverse_words model --data $WORK/data --output $WORK/runs/reverse-init \
&& python -m raylm train $COMMON --run.name=lora-chat --model.path=$WORK/runs/reverse-init \
--data.source=$WORK/data/train.jsonl --data.format=chat --data.seq_len=63 --lora.rank=8 \
--train.steps=10 --train.global_batch_size=8 --train.micro_batch_size=8 \
--train.precision=fp32 --train.log_every=5 --checkpoint.every=5"
# DPO as a full fine-tune of the same model: the reference pass (Ray Data actors) first.
DPO="python -m raylm train $COMMON --run.name=dpo-full --model.path=$WORK/runs/reverse-init \
--data.source=$WORK/data/train_pairs.jsonl --data.format=preference --train.objective=dpo \
--data.seq_len=127 --train.steps=6 --train.global_batch_size=8 --train.micro_batch_size=8 \
--train.precision=fp32 --train.log_every=3 --checkpoint.every=3 --optim.lr=1e-5"
TUNE="python -m raylm tune --config jobs/configs/cpu_tiny.yaml $COMMON \
--data.builtin_packages=[peft,transformers] --run.name=sweep --tune.num_samples=2 \
--train.steps=6 --train.log_every=3 --train.eval_every=3 --checkpoint.every=3"
RAYLM_WHEELS="$WORK/wheels" RAYLM_SITE="$WORK/site" PYTHON="$WORK/venv/bin/python" \
    PATH="$WORK/venv/bin:$PATH" \
    bash scripts/gpu_run.sh "$WORK/out" "$TINY --train.steps=10" "$TINY --train.steps=20" \
    "$LORA" "$DPO" "$TUNE" "python -m raylm.bench mfu --help"
