"""A benchmark's console holds its own lines and JSON (raylm.bench.__main__.quiet_console):
transformers draws a bar for each model read or written, and MLflow one for each artifact
downloaded, unless told otherwise before they are imported."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
from raylm.bench.__main__ import quiet_console

quiet_console()
import sys, tempfile
import transformers as T
from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

config = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
with tempfile.TemporaryDirectory() as d:
    T.LlamaForCausalLM(config).save_pretrained(d)
    T.AutoModelForCausalLM.from_pretrained(d)
print("mlflow bars", MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get())
"""


def test_a_benchmark_draws_no_progress_bars_of_the_libraries():
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mlflow bars False" in p.stdout
    for bar in ("Loading weights", "Writing model shards", "it/s]"):
        assert bar not in p.stderr, p.stderr[-3000:]
