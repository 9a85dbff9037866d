"""``raylm prune`` on a model directory with prepared data written here (no Ray): the pruned
directory, its report, and the refusals. A run directory's path (its own data, its MLflow run)
is tested with a real run in tests/integration/test_train.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from raylm.cli import main
from raylm.contracts import EXPORT_INFO, LAYOUT, SPLITS
from raylm.data.preparation import BlockWriter
from tests.conftest import make_docs, save_tiny_llama, tokenizer_vocab
from tests.unit.model.test_sparsity import layer_sparsity

L = 33  # 32-token blocks and their next-token targets


def write_prepared(root: Path, tokenizer_dir: Path, *, docs: int = 200) -> Path:
    """Prepared data as ``raylm prepare`` lays it out, written without Ray: the documents
    tokenized end to end with EOS between them and cut into blocks, 90% train, 10% val."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = np.concatenate([np.array(tok.encode(d).ids + [0]) for d in make_docs(docs)])
    blocks = ids[: len(ids) // L * L].reshape(-1, L).astype(np.int32)
    cut = len(blocks) * 9 // 10
    splits = {}
    for split, part in zip(SPLITS, (blocks[:cut], blocks[cut:]), strict=True):
        w = BlockWriter(root / split, block_length=L, group_rows=16)
        w.add(part, [np.array([0], dtype=np.int32)] * len(part),
              [np.zeros(0, dtype=np.int64)] * len(part))
        w.close()
        splits[split] = {"blocks": len(part), "files": w.files,
                         "row_group_sizes": w.group_sizes, "file_groups": w.file_groups}
    (root / LAYOUT).write_text(json.dumps({"block_length": L, "eos_id": 0, "seq_len": L - 1,
                                           "loss_mask": False, "splits": splits}))
    return root


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("prune")
    model = save_tiny_llama(root / "model", vocab_size=tokenizer_vocab(tokenizer_dir))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, model / f.name)
    return model, write_prepared(root / "prepared", tokenizer_dir)


def test_a_model_directory_is_pruned_into_one_that_loads_with_its_report(model_and_data,
                                                                          tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raylm.model import sparsity

    model, data = model_and_data
    out = tmp_path / "pruned"
    assert main(["prune", str(model), "--data", str(data), "--output", str(out),
                 "--sparsity", "0.5", "--calibration-blocks", "8"]) == 0
    said = capsys.readouterr().out
    assert "pruned 14 layers" in said and "by wanda" in said and "validation loss" in said
    report = json.loads((out / EXPORT_INFO).read_text())
    assert report["kind"] == "model-pruned" and report["method"] == "wanda"
    assert report["sparsity"] == "50%" and report["layer_sparsity"] == 0.5
    assert report["calibration_blocks"] == 8 and len(report["layers"]) == 14
    assert 0 < report["model_sparsity"] < 0.5  # the embeddings and head stay dense
    # Stored dense (safetensors has no sparse tensors); smaller in a sparse format.
    assert report["compressed_bytes"] < report["dense_bytes"] <= report["bytes"] * 1.01
    assert np.isfinite(report["val_loss"]) and np.isfinite(report["val_loss_before"])
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert [r["sparsity"] for r in layer_sparsity(loaded)] == [0.5] * 14
    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id is not None
    assert sparsity.is_pruned(out) and not sparsity.is_pruned(model)

    # 2:4 by magnitude, which needs no calibration data, and its own kind of output.
    semi = tmp_path / "semi"
    assert main(["prune", str(model), "--output", str(semi), "--sparsity", "2:4",
                 "--method", "magnitude"]) == 0
    report = json.loads((semi / EXPORT_INFO).read_text())
    assert report["sparsity"] == "2:4" and report["val_loss"] is None
    weight = sparsity.prunable(AutoModelForCausalLM.from_pretrained(str(semi)))[0][1].weight
    assert ((weight.reshape(weight.shape[0], -1, 4) != 0).sum(dim=-1) == 2).all()


def test_mistakes_are_refused_in_one_line_before_anything_is_written(model_and_data, tmp_path,
                                                                     capsys, tokenizer_dir):
    model, data = model_and_data
    out = tmp_path / "out"
    cases = [
        (["--sparsity", "0.5"], "--method wanda scores weights by the activations"),
        (["--sparsity", "0.5", "--data", str(tmp_path)], "not prepared data"),
        (["--sparsity", "3:4", "--data", str(data)], "2:4"),
        (["--sparsity", "0.5", "--data", str(data), "--calibration-blocks", "0"],
         "at least 1"),
    ]
    for args, says in cases:
        assert main(["prune", str(model), "--output", str(out), *args]) == 2
        assert says in capsys.readouterr().err
    assert main(["prune", str(tmp_path), "--output", str(out), "--sparsity", "0.5"]) == 2
    assert "neither a raylm run directory nor a model directory" in capsys.readouterr().err
    assert main(["prune", str(model), "--output", str(model), "--sparsity", "0.5",
                 "--method", "magnitude"]) == 2
    assert "the source" in capsys.readouterr().err
    assert main(["prune", str(model), "--output", str(out), "--sparsity", "0.5",
                 "--train.steps=3"]) == 2
    assert "takes no config overrides" in capsys.readouterr().err
    # Data tokenized for a larger vocabulary than the model's.
    small = save_tiny_llama(tmp_path / "small", vocab_size=64)
    shutil.copy(tokenizer_dir / "tokenizer.json", small / "tokenizer.json")
    assert main(["prune", str(small), "--output", str(out), "--sparsity", "0.5",
                 "--data", str(data)]) == 2
    assert "past the model's vocabulary of 64" in capsys.readouterr().err
    assert not out.exists()
