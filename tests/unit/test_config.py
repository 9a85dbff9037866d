from __future__ import annotations

import re

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
        ("--train.steps=0", "Invalid value for 'train.steps': 0. Allowed: >= 1."),
        # Each worker's stream lists its samples: 2**30 at most.
        ("--train.steps=" + "1" + "0" * 30, "Allowed: at most 67,108,864"),
        ("--train.steps=67108865", "Allowed: at most 67,108,864 with train.global_batch_size"
                                   "=16 over 1 data-parallel worker(s) at the fewest"),
        ("--data.on_bad_record=maybe", "Expected one of 'skip', 'error'"),
        ("--data.dedup=7", "Invalid value for 'data.dedup': 7. Expected true/false."),
        ("--data.val_fraction=1.5", "'data.val_fraction': 1.5. Allowed: 0 <= x < 1"),
        ("--scaling.num_workers=[2, 1]", "'scaling.num_workers': [2, 1]"),
        ("--tune.lr_min=0.1", "'tune.lr_min/tune.lr_max'"),
        ("--tune.schedules=[cosine, zigzag]", "'tune.schedules'"),
        ("--train.precision=fp8", "one of 'auto', 'fp32', 'bf16-mixed', 'bf16-true'"),
        ("--train", "write it as --section.key=value"),
        ("--scaling.worker_resources=4", "Expected a mapping of a string to a finite number."),
        ("--scaling.worker_resources={GPU: 1}", "not CPU/GPU: use scaling.cpus_per_worker and "
                                                "scaling.use_gpu"),
        ("--scaling.data_resources={CPU: 1}", "Invalid value for 'scaling.data_resources'"),
    ],
)
def test_bad_overrides_name_key_value_and_fix(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_registering_a_model_needs_it_logged():
    for off in ("--tracking.log_model=false", "--tracking.enabled=false"):
        with pytest.raises(ConfigError, match="'tracking.register_as': 'lm'. Allowed: unset, or "
                                              "a model name with tracking.enabled=true"):
            load_config(None, ["--tracking.register_as=lm", off])
    assert load_config(None, ["--tracking.register_as=lm"]).tracking.register_as == "lm"


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


def test_alias_bomb_is_refused_in_a_screenful(tmp_path, capsys):
    # 329 bytes: each level holds ten aliases of the one before, 10^8 values once expanded.
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("train:\n" + "\n".join("  " + line for line in lines) + "\n")
    with pytest.raises(ConfigError, match="aliases expand to more than 10,000 values"):
        load_config(bomb)
    assert main(["config", "show", "--config", str(bomb)]) == 2
    err = capsys.readouterr().err
    assert len(err) < 1200 and err.count("\n") == 1
    # An alias used a few times is fine.
    ok = tmp_path / "ok.yaml"
    ok.write_text("tune:\n  warmup_steps: &w [0, 10]\n  weight_decays: [0.0]\n"
                  "train: {steps: 5}\n")
    assert load_config(ok).tune.warmup_steps == [0, 10]
    own = tmp_path / "own.yaml"
    own.write_text("train: &t\n  x: *t\n")
    with pytest.raises(ConfigError, match="refers to its own anchor"):
        load_config(own)


def test_long_values_are_cut_in_messages():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--run.name=" + "x/" * 50_000])
    assert len(str(e.value)) < 400 and "100,002 characters" in str(e.value)


@pytest.mark.parametrize("name", ["..", ".hidden", "a/b", "run#1", "50%", "why?", "x" * 129, ""])
def test_a_run_name_is_a_safe_directory_and_url_name(name):
    with pytest.raises(ConfigError, match=r"Invalid value for 'run.name'.*letters, digits"):
        load_config(None, [f"--run.name={name}"])


@pytest.mark.parametrize(("override", "allowed"), [
    ("--scaling.num_workers=[1, 1000000000]", "1 to 100,000"),
    ("--tokenizer.vocab_size=100000000", "to 1,048,576"),
    ("--data.shuffle_window=1000000", "1 to 4,096"),
    ("--train.spike_window=100000000", "3 to 10,000"),
    ("--train.log_every=100000000", "1 to 1,000"),
])
def test_values_that_size_allocations_have_a_ceiling(override, allowed):
    with pytest.raises(ConfigError, match=f"Allowed: .*{allowed}"):
        load_config(None, [override])


@pytest.mark.parametrize("key", ["text_field", "messages_field", "prompt_field",
                                 "completion_field", "chosen_field", "rejected_field"])
def test_every_field_name_of_the_data_must_be_given(key):
    with pytest.raises(ConfigError, match=f"data.{key}.*a non-empty field name"):
        load_config(None, [f"--data.{key}="])


def test_duplicate_keys_are_refused_with_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 5\n  seed: 1\n  steps: 50\n")
    with pytest.raises(ConfigError, match=r"key 'steps' appears twice in one mapping, at line "
                                          r"2 column 3 and line 4 column 3"):
        load_config(path)
    sections = tmp_path / "sections.yaml"
    sections.write_text("train: {steps: 5}\ndata: {seq_len: 64}\ntrain: {seed: 1}\n")
    with pytest.raises(ConfigError, match="key 'train' appears twice .* line 1 .* line 3"):
        load_config(sections)
    one_line = tmp_path / "one_line.yaml"
    one_line.write_text("train: {steps: 1, steps: 999}\n")
    with pytest.raises(ConfigError, match="key 'steps' appears twice .* line 1 column 9 and "
                                          "line 1 column 19"):
        load_config(one_line)
    # YAML's merge key is how a file overrides what it merged: not a duplicate.
    merged = tmp_path / "merged.yaml"
    merged.write_text("train:\n  <<: {steps: 5, seed: 2}\n  steps: 7\n")
    cfg = load_config(merged)
    assert cfg.train.steps == 7 and cfg.train.seed == 2


def test_a_file_nested_too_deeply_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text("train: " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["config", "show", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "it nests too deeply to read" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("override", ["--optim.lr=inf", "--optim.grad_clip=.inf",
                                      "--optim.lr=nan", "--optim.beta1=.nan",
                                      "--scaling.cpus_per_worker=-.inf",
                                      "--scaling.worker_resources={trainer: .inf}",
                                      "--tune.lr_max=1e400"])
def test_infinity_and_nan_are_refused(override):
    with pytest.raises(ConfigError, match="Expected .*a finite number"):
        load_config(None, [override])


def test_an_override_without_a_value_is_refused_as_such(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 50\n")
    assert main(["config", "show", "--train.steps", "--config", str(path)]) == 2
    assert capsys.readouterr().err == ("raylm: error: Override --train.steps has no value: "
                                       "write --train.steps=VALUE.\n")
    assert main(["config", "show", "--train.steps"]) == 2
    assert "--train.steps has no value" in capsys.readouterr().err
    # A negative number is a value, not an option.
    assert main(["config", "show", "--train.max_failures", "-1"]) == 0
    assert "max_failures: -1" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "tune", "prepare", "submit"])
def test_help_says_every_key_is_an_override(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Every config key is also an option: --section.key=value" in out
    assert "raylm config show" in out and "docs/configuration-reference.md" in out



@pytest.mark.parametrize("command", ["train", "tune"])
def test_seq_len_beyond_the_models_positions_fails_before_ray_starts(command, capsys,
                                                                      ray_never_starts):
    assert main([command, "--data.seq_len=2048", "--tracking.enabled=false"]) == 2
    assert capsys.readouterr().err == (
        "raylm: error: data.seq_len=2048 is above the 1024 positions of model.preset=tiny; "
        "lower data.seq_len or choose a model with more positions.\n")


def test_a_pretrained_models_own_tokenizer_is_the_default(tmp_path, tokenizer_dir):
    import shutil

    from raylm.data.preparation import given_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert given_tokenizer(load_config(None, [f"--model.path={model}"])) is None
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, model / f.name)
    assert given_tokenizer(load_config(None, [f"--model.path={model}"])) == model.resolve()
    # tokenizer.path wins.
    assert given_tokenizer(load_config(None, [f"--model.path={model}",
                                              f"--tokenizer.path={tokenizer_dir}"])) == \
        tokenizer_dir.resolve()


def test_an_nf4_base_is_refused_on_cpu_workers_before_ray_starts(capsys, ray_never_starts):
    qlora = ["--model.path=/models/base", "--lora.rank=16", "--lora.base_quantization=nf4"]
    assert main(["train", *qlora, "--scaling.use_gpu=false", "--tracking.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylm: error: Invalid value for 'lora.base_quantization': 'nf4'. "
                          "Allowed: none on CPU workers") and err.count("\n") == 1
    with pytest.raises(ConfigError, match="none unless lora.rank >= 1"):
        load_config(None, ["--model.path=/models/base", "--lora.base_quantization=nf4",
                           "--scaling.use_gpu=true"])
    assert load_config(None, [*qlora, "--scaling.use_gpu=true"]).lora.base_quantization == "nf4"


def test_float8_is_refused_where_it_cannot_run_before_ray_starts(capsys, ray_never_starts):
    assert main(["train", "--model.float8=tensorwise", "--scaling.use_gpu=false",
                 "--tracking.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylm: error: Invalid value for 'model.float8': 'tensorwise'. "
                          "Allowed: off on CPU workers") and err.count("\n") == 1
    gpu = ["--model.float8=rowwise", "--scaling.use_gpu=true"]
    with pytest.raises(ConfigError, match="off with LoRA"):
        load_config(None, [*gpu, "--model.path=/models/base", "--lora.rank=8"])
    with pytest.raises(ConfigError, match="off with parallel.tensor > 1"):
        load_config(None, [*gpu, "--parallel.tensor=2", "--scaling.num_workers=2"])
    with pytest.raises(ConfigError, match="Expected one of 'off', 'tensorwise', 'rowwise'"):
        load_config(None, ["--model.float8=e4m3"])
    assert load_config(None, gpu).model.float8 == "rowwise"


def test_dpo_settings_that_cannot_train_are_refused_before_ray_starts(capsys, ray_never_starts):
    dpo = ["--train.objective=dpo", "--data.format=preference", "--model.path=/models/base",
           "--lora.rank=8"]
    assert load_config(None, dpo).dpo.loss == "sigmoid"
    for extra, message in [
        (["--data.format=chat"], "dpo trains on data.format=preference"),
        (["--data.loss_on=all"], "the loss scores the answers only"),
        (["--data.cross_document_attention=true"], "must not see each other"),
        (["--parallel.tensor=2", "--scaling.num_workers=2"], "dpo runs on data-parallel"),
        (["--dpo.beta=0"], "'dpo.beta': 0"),
        (["--dpo.label_smoothing=0.5"], "0 <= x < 0.5"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*dpo, *extra])
    # Full fine-tuning: SimPO needs no reference, DPO's is the pretrained model.path (scored
    # before training); from scratch, only SimPO has something to compare with.
    assert load_config(None, [*dpo, "--lora.rank=0", "--dpo.loss=simpo"]).lora.rank == 0
    assert load_config(None, [*dpo, "--lora.rank=0", "--dpo.loss=ipo"]).dpo.loss == "ipo"
    assert load_config(None, [*dpo[:2], "--dpo.loss=simpo"]).model.path is None
    with pytest.raises(ConfigError, match="preference pairs train with train.objective=dpo"):
        load_config(None, ["--data.format=preference"])
    assert main(["train", *dpo[:2], "--tracking.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "Invalid value for 'dpo.loss'" in err and "set model.path" in err


def test_a_relative_model_path_travels_absolute(tmp_path, monkeypatch):
    """Workers, Tune trials and exports run in other directories than the command."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "base-hf").mkdir(parents=True)
    cfg = load_config(None, ["--model.path=runs/base-hf"])
    assert cfg.model.path == str(tmp_path.resolve() / "runs" / "base-hf")
    assert load_config(None, []).model.path is None
    # The same form with no such directory here is a hub id, resolved at the entry point.
    assert load_config(None, ["--model.path=runs/other-hf"]).model.path == "runs/other-hf"


def test_python_overrides_are_a_mapping_checked_like_the_command_lines():
    cfg = load_config(None, {"train.steps": 20, "tune.schedules": ["wsd"],
                             "scaling.use_gpu": False})
    assert cfg.train.steps == 20 and cfg.tune.schedules == ["wsd"]
    # A Config is a starting point too, and overrides on it leave it as it was.
    again = load_config(cfg, {"optim.lr": 5e-4})
    assert again.train.steps == 20 and again.optim.lr == 5e-4 and cfg.optim.lr != 5e-4
    with pytest.raises(ConfigError, match="'steps' is not 'section.key'"):
        load_config(None, {"steps": 3})
    with pytest.raises(ConfigError, match="Did you mean 'train.steps'"):
        load_config(None, {"train.stepz": 3})
    with pytest.raises(ConfigError, match="'train.steps': 'x'"):
        load_config(None, {"train.steps": "x"})


def test_tensor_parallel_layouts_that_cannot_split_are_refused_before_ray_starts(
        capsys, ray_never_starts):
    tp2 = ["--parallel.tensor=2", "--tracking.enabled=false"]
    with pytest.raises(ConfigError, match=r"allows 3 workers, which do not split into "
                                          r"groups of parallel.tensor=2 = 2 workers "
                                          r"\(3 = 1 x 2 \+ 1\)"):
        load_config(None, [*tp2, "--scaling.num_workers=3"])
    # An elastic range may start any count in between.
    with pytest.raises(ConfigError, match="allows 3 workers.*a range needs min = max"):
        load_config(None, [*tp2, "--scaling.num_workers=[2, 4]"])
    assert load_config(None, [*tp2, "--scaling.num_workers=[4, 4]"]).parallel.tensor == 2
    # The global batch is split over data-parallel ranks: 6 workers at tp 2 are 3 of them.
    with pytest.raises(ConfigError, match=r"cannot be split equally over 3 data-parallel "
                                          r"ranks \(workers / 2, the workers of a tensor x "
                                          r"pipeline group\)"):
        load_config(None, [*tp2, "--scaling.num_workers=6", "--train.global_batch_size=16"])
    with pytest.raises(ConfigError, match="'parallel.tensor': 0"):
        load_config(None, ["--parallel.tensor=0"])
    # The model's heads and the sequence: the tiny preset has 4 heads, 4 KV heads.
    assert main(["train", "--model.preset=tiny", "--parallel.tensor=8",
                 "--scaling.num_workers=8", "--train.global_batch_size=8", "--data.seq_len=64",
                 "--tracking.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylm: error: parallel.tensor=8 does not divide the model's 4 "
                          "attention heads (4 = 0 x 8 + 4)") and err.count("\n") == 1
    assert main(["train", "--model.preset=tiny", "--parallel.tensor=4", "--data.seq_len=34",
                 "--scaling.num_workers=4", "--tracking.enabled=false"]) == 2
    assert "does not divide the model's 34 tokens per sequence (data.seq_len)" in \
        capsys.readouterr().err
    # The 1b preset: 32 attention heads, 8 key/value heads.
    assert main(["train", "--model.preset=1b", "--parallel.tensor=16",
                 "--scaling.num_workers=16", "--train.global_batch_size=16",
                 "--tracking.enabled=false"]) == 2
    assert "does not divide the model's 8 key/value heads (8 = 0 x 16 + 8)" in \
        capsys.readouterr().err


def test_pipelines_that_cannot_be_cut_or_filled_are_refused_before_ray_starts(
        capsys, ray_never_starts):
    pp2 = ["--parallel.pipeline=2", "--tracking.enabled=false"]
    with pytest.raises(ConfigError, match=r"allows 6 workers, which do not split into groups "
                                          r"of parallel.tensor=2 x parallel.pipeline=2 = 4 "
                                          r"workers \(6 = 1 x 4 \+ 2\)"):
        load_config(None, [*pp2, "--parallel.tensor=2", "--scaling.num_workers=6"])
    with pytest.raises(ConfigError, match="'parallel.pipeline': 0"):
        load_config(None, ["--parallel.pipeline=0"])
    with pytest.raises(ConfigError, match="parallel.pipeline_schedule"):
        load_config(None, [*pp2, "--parallel.pipeline_schedule=zero-bubble"])
    # 8 sequences over 2 data-parallel ranks are 4 each: one micro-batch of 8 would not fill
    # 2 stages.
    filled = [*pp2, "--scaling.num_workers=4", "--train.global_batch_size=8",
              "--train.micro_batch_size=8"]
    with pytest.raises(ConfigError, match=r"parallel.pipeline=2 stages over 1 micro-batch per "
                                          r"step would leave stages idle: each data-parallel "
                                          r"rank's 4 sequences .* set "
                                          r"parallel.pipeline_microbatches=2"):
        load_config(None, filled)
    assert load_config(None, [*filled, "--parallel.pipeline_microbatches=2"])
    assert load_config(None, [*filled, "--train.micro_batch_size=2"])
    with pytest.raises(ConfigError, match="pipeline_microbatches=3 does not divide each "
                                          "data-parallel rank's 4 sequences"):
        load_config(None, [*filled, "--parallel.pipeline_microbatches=3"])
    # The model: the tiny preset has 2 layers; the 1b preset ties its embeddings.
    assert main(["train", "--model.preset=tiny", "--parallel.pipeline=4",
                 "--scaling.num_workers=4", "--train.global_batch_size=8",
                 "--train.micro_batch_size=1", "--tracking.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylm: error: parallel.pipeline=4 needs at least one decoder layer "
                          "per stage; the model has 2") and err.count("\n") == 1
    assert main(["train", "--model.preset=1b", *pp2, "--scaling.num_workers=2",
                 "--train.global_batch_size=8", "--train.micro_batch_size=2"]) == 2
    assert "ties its output head to its input embedding" in capsys.readouterr().err


def test_an_unnamed_run_is_named_after_its_job_so_another_job_never_resumes_it():
    from raylm.config import default_run_name, for_sweep

    def name(*overrides):
        return load_config(None, list(overrides)).run.name

    assert name() == "tiny-builtin" == default_run_name(Config())
    assert name("--model.preset=small", "--data.source=/data/corpus/*.txt") == "small-corpus"
    assert name("--model.path=Qwen/Qwen2.5-0.5B-Instruct", "--lora.rank=16",
                "--data.format=chat", "--data.source=data/chats.jsonl") == \
        "Qwen2.5-0.5B-Instruct-chats-lora"
    assert name("--model.path=/models/answers", "--lora.rank=16", "--train.objective=dpo",
                "--data.format=preference", "--data.source=[data/pairs.jsonl, more.jsonl]",
                "--dpo.loss=ipo") == "answers-pairs-and-1-more-lora-ipo"
    assert name("--data.source=hf:roneneldan/TinyStories") == "tiny-TinyStories"
    assert name("--run.name=mine") == "mine"
    # A sweep of the same job gets a directory of its own; a name given is kept.
    assert for_sweep(load_config(None, [])).run.name == "tiny-builtin-sweep"
    assert for_sweep(load_config(None, ["--run.name=mine"])).run.name == "mine"
    # The Python API's config and overrides: the name follows what the overrides make.
    assert load_config(Config(), {"model.preset": "small"}).run.name == "small-builtin"


def test_grpo_settings_that_cannot_train_are_refused_before_ray_starts(tmp_path, capsys,
                                                                        ray_never_starts):
    grpo = ["--train.objective=grpo", "--data.format=prompt", "--rl.reward=exact_match"]
    assert load_config(None, grpo).rl.group_size == 8
    for extra, message in [
        (["--data.format=chat"], "grpo trains on data.format=prompt"),
        (["--rl.reward=null"], "a reward function for train.objective=grpo"),
        (["--data.cross_document_attention=true"], "false \\(or unset\\) with train.objective"),
        (["--parallel.tensor=2", "--scaling.num_workers=2"], "grpo runs on data-parallel"),
        (["--rl.group_size=1"], "'rl.group_size': 1"),
        (["--rl.top_p=0"], "0 < x <= 1"),
        (["--rl.clip_low=1"], "0 <= x < 1"),
        (['--rl.generator_resources={"CPU": -1}'], "amounts >= 0"),
        (["--rl.max_staleness=-1"], "'rl.max_staleness': -1"),
        (["--rl.generators=[2, 1]"], r"\[min, max\] with 1 <= min <= max"),
        (["--rl.generators=[0, 2]"],
         "'rl.generators': \\[0, 2\\]. Allowed: an integer >= 0 \\(0: colocated\\)"),
        (["--rl.generators=[1, 2, 3]"], "'rl.generators'"),
        (["--rl.updates_per_step=4", "--train.global_batch_size=12",
          "--scaling.num_workers=[1, 2]"], r"train.global_batch_size=12 / 2 workers"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*grpo, *extra])
    with pytest.raises(ConfigError, match="prompts train with train.objective=grpo"):
        load_config(None, ["--data.format=prompt"])
    with pytest.raises(ConfigError, match="unset unless train.objective=grpo"):
        load_config(None, ["--rl.reward=exact_match"])
    # The reward function is imported and called on the data's first row before Ray starts.
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "2+2?", "solution": "4"}\n')
    assert main(["train", *grpo, f"--data.source={data}", "--tracking.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylm: error: rl.reward='exact_match' cannot be called as "
                          "fn(prompt, completion, **columns) with this data's columns "
                          "['solution']") and err.count("\n") == 1
    assert main(["train", *grpo[:2], "--rl.reward=no_such_module:f",
                 f"--data.source={data}", "--tracking.enabled=false"]) == 2
    assert "module 'no_such_module' does not import" in capsys.readouterr().err


def test_tune_choices_take_known_keys_and_valid_values_only():
    cfg = load_config(None, ['--tune.choices={"rl.clip_high": [0.2, 0.28], "data.seq_len": [64]}'])
    assert cfg.tune.choices == {"rl.clip_high": [0.2, 0.28], "data.seq_len": [64]}
    for choices, says in [
        ('{"rl.clip_higher": [0.3]}', "'tune.choices': 'rl.clip_higher'"),
        ('{"optim.lr": [0.1]}', "which have tune lists of their own"),
        ('{"run.name": ["a", "b"]}', "outside run.* and tune.*"),
        ('{"rl.top_p": []}', "a non-empty list of values"),
        ('{"rl.clip_low": [0.1, 1.5]}', "'rl.clip_low': 1.5"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(None, [f"--tune.choices={choices}"])


def test_a_removed_key_says_what_took_its_place():
    with pytest.raises(ConfigError, match=r"Unknown config key 'tune.min_lr_ratios'. It was "
                                          r"removed: use tune.choices, as "):
        load_config(None, ["--tune.min_lr_ratios=[0.1]"])
    # A config saved before it went holds it at its default: read as its absence.
    assert load_config(None, ["--tune.min_lr_ratios=[]"]) == load_config(None, [])
    # What took its place sweeps it.
    from raylm.run.sweep import search_space

    swept = load_config(None, ['--tune.choices={"optim.min_lr_ratio": [0.05, 0.1]}'])
    assert search_space(swept)["optim.min_lr_ratio"].categories == [0.05, 0.1]
