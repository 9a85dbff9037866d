from __future__ import annotations

import pytest
import yaml

from raylm.cli import main
from raylm.config import Config, ConfigError, load_config


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.data.source == "builtin" and cfg.data.seq_len == 256


def test_cli_beats_yaml_beats_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": 50, "seed": 7}, "data": {"seq_len": 64}}))
    cfg = load_config(path, ["--train.steps=9", "--optim.lr=3e-4"])
    assert cfg.train.steps == 9  # CLI over YAML
    assert cfg.train.seed == 7  # YAML over default
    assert cfg.data.seq_len == 64
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.train.log_every == 10  # default


def test_override_values_are_typed():
    cfg = load_config(None, ["--scaling.num_workers=[1, 2]", "--data.dedup=false",
                             "--data.source=[a.jsonl, b.txt]", "--optim.lr=1", "--run.name=42",
                             "--scaling.worker_resources={trainer: 1}"])
    assert cfg.scaling.num_workers == [1, 2] and cfg.scaling.worker_range == (1, 2)
    assert cfg.scaling.worker_resources == {"trainer": 1.0}
    assert cfg.data.dedup is False
    assert cfg.data.source == ["a.jsonl", "b.txt"]
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.run.name == "42"


@pytest.mark.parametrize(
    "override, message",
    [
        ("--train.stpes=3", "Unknown config key 'train.stpes'. Did you mean 'train.steps'?"),
        ("--trian.steps=3", "Unknown config section 'trian' (command line). Did you mean 'train'?"),
        ("--train.steps=1.5", "Invalid value for 'train.steps': 1.5. Expected an integer."),
        ("--train.steps=0", "Invalid value for 'train.steps': 0. Allowed: an integer >= 1."),
        ("--data.on_bad_record=maybe", "Expected one of 'skip', 'error'"),
        ("--data.dedup=7", "Invalid value for 'data.dedup': 7. Expected true/false."),
        ("--data.val_fraction=1.5", "'data.val_fraction': 1.5. Allowed: 0 <= x < 1"),
        ("--scaling.num_workers=[2, 1]", "'scaling.num_workers': [2, 1]"),
        ("--tune.lr_min=0.1", "'tune.lr_min/tune.lr_max'"),
        ("--tune.schedules=[cosine, zigzag]", "'tune.schedules'"),
        ("--train.precision=fp8", "one of 'auto', 'fp32', 'bf16-mixed', 'bf16-true'"),
        ("--train", "write it as --section.key=value"),
        ("--scaling.worker_resources=4", "Expected a mapping of a string to a number."),
        ("--scaling.worker_resources={GPU: 1}", "not CPU/GPU: use scaling.cpus_per_worker and "
                                                "scaling.use_gpu"),
        ("--scaling.data_resources={CPU: 1}", "Invalid value for 'scaling.data_resources'"),
    ],
)
def test_bad_overrides_name_key_value_and_fix(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="Config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("data:\n  sorce: x.jsonl\n")
    with pytest.raises(ConfigError, match="Did you mean 'data.source'"):
        load_config(wrong)
    flat = tmp_path / "flat.yaml"
    flat.write_text("train: 5\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(flat)


def test_config_show_prints_resolved_yaml(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 50\n")
    assert main(["config", "show", "--config", str(path), "--train.seed", "3"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["steps"] == 50 and shown["train"]["seed"] == 3
    # What `config show` prints is itself a valid config file.
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(shown))
    assert load_config(again).train.seed == 3


def test_cli_error_is_one_line(capsys):
    assert main(["config", "show", "--model.presett=tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylm: error: Unknown config key 'model.presett'")
    assert "Traceback" not in err and err.count("\n") == 1
