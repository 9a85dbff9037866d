"""raylm's Python API: what the ``raylm`` command runs, callable from notebooks and scripts.

    import raylm

    run = raylm.train("jobs/configs/cpu_tiny.yaml", overrides={"train.steps": 20})
    run.history.plot(x="step", y=["loss", "val_loss"])
    raylm.export(run, "runs/tiny-hf")
    raylm.prune(run, "runs/tiny-pruned", sparsity=0.5)
    print(raylm.generate(run, "The river"))
    raylm.evaluate(run, overrides={"eval.tasks": ["my_task"], "eval.include_path": "my_tasks"})

``prepare``, ``train`` and ``tune`` take a config first (a YAML path, a :class:`Config`, or
None for the defaults) and ``overrides``, a mapping of ``section.key`` to value, checked exactly
as the CLI's ``--section.key=value`` (same errors, before Ray starts). ``export``, ``generate``
``prune`` and ``evaluate`` take a run (a :class:`Run`, or its directory) or, for ``generate``,
``prune`` and ``evaluate``, a model directory.

Ray: each call joins the cluster that ``run.ray_address`` or ``RAY_ADDRESS`` names, or, when
neither is set, starts a local one the first time and keeps it for the process, so a
notebook's later cells reuse it; Ray shuts it down when the process (the kernel) exits, or
call :func:`shutdown`. Training a run whose ``run.name`` exists resumes it (a finished run
returns at once), with the same MLflow run: re-running a cell never duplicates a run.

Results are read from what the run wrote (``summary.json``, ``events.jsonl``), never from
printed output: a :class:`Run` opened later, in another process, says the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raylm import storage
from raylm.config import Config, load_config
from raylm.contracts import RUN_INFO
from raylm.contracts.events import Benchmark, Progress
from raylm.contracts.summary import Summary, SweepSummary

if TYPE_CHECKING:
    import pandas as pd

ConfigLike = str | os.PathLike | Config | None
Overrides = Mapping[str, Any] | None


def _say(message: str) -> None:
    print(message, flush=True)


def resolve(config: ConfigLike = None, overrides: Overrides = None) -> Config:
    """The config a call runs with: defaults, ``config``, then ``overrides``."""
    return load_config(config, overrides or {})


class Run:
    """A training run, read from its directory (``run.storage_path/run.name``)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = str(run_dir)
        if not storage.is_file(storage.join(self.run_dir, RUN_INFO)):
            raise ValueError(f"{self.run_dir} is not a raylm run directory (no run.json); "
                             f"runs live in run.storage_path/run.name.")

    def __repr__(self) -> str:
        s = self.record
        return (f"Run({self.run_dir!r}, status={s and s.status}, step={s and s.final_step}, "
                f"val_loss={s and s.val_loss})")

    @property
    def record(self) -> Summary | None:
        """``summary.json`` as its record (:class:`raylm.contracts.summary.Summary`); None
        before the run has written one."""
        from raylm.rundir import read_summary

        return read_summary(self.run_dir)

    @property
    def summary(self) -> dict[str, Any]:
        """``summary.json``: status, final step and losses, throughput, restarts, ..."""
        s = self.record
        return s.to_dict() if s is not None else {}

    @property
    def config(self) -> Config:
        """The config the run last trained with."""
        from raylm.config import config_from_dict
        from raylm.rundir import read_run_info

        return config_from_dict(read_run_info(self.run_dir).config)

    @property
    def checkpoint(self) -> str | None:
        """The newest checkpoint's path."""
        s = self.record
        return s and s.checkpoint_path

    @property
    def mlflow_run_id(self) -> str | None:
        s = self.record
        return s and s.mlflow_run_id

    @property
    def history(self) -> pd.DataFrame:
        """One row per reported step (``step``, ``loss``, ``val_loss`` where evaluated, ``lr``,
        ``grad_norm``, ``tokens_per_s``, ..., ``time`` of the report, ``step_time``), over
        every invocation of the run, with the benchmark scores (``eval/<task>/<metric>``) at
        the steps of the checkpoints they score. A step trained twice (a restart resumed
        before it) keeps its last report: the one on the path that the model took."""
        import pandas as pd

        from raylm.run.record import read

        rows: dict[int, dict[str, Any]] = {}
        scores: dict[int, dict[str, float]] = {}
        for r in read(self.run_dir):
            if isinstance(r, Progress):
                rows[r.step] = r.history()
            elif isinstance(r, Benchmark):
                scores.setdefault(r.step, {}).update(r.scores)
        for step, values in scores.items():
            rows.setdefault(step, {"step": step}).update(values)
        return pd.DataFrame([rows[s] for s in sorted(rows)])

    @property
    def goodput(self) -> pd.DataFrame:
        """Where the run's wall time went, every invocation (:mod:`raylm.run.goodput`): one
        row per cause (``productive``, ``recomputed``, ``data_wait``, ``generation`` and
        ``weight_transfer`` in reinforcement learning, ``checkpoint``, ``evaluation``, ...,
        ``other``) with its ``seconds`` and ``share`` of the total; ``goodput`` is the
        ``productive`` share. Read from the run's records, so a running run's shows it so far."""
        import pandas as pd

        from raylm.run.goodput import goodput, table
        from raylm.run.record import read

        return pd.DataFrame(table(goodput(read(self.run_dir)))).set_index("cause")


class Sweep:
    """A Tune sweep, read from its directory's ``tune_summary.json``."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = str(run_dir)
        path = storage.join(self.run_dir, SweepSummary.FILE)
        if not storage.is_file(path):
            raise ValueError(f"{self.run_dir} holds no {SweepSummary.FILE}: not a finished "
                             f"raylm sweep.")
        self.record = SweepSummary.from_json(storage.read_text(path))
        self.summary: dict[str, Any] = self.record.to_dict()

    def __repr__(self) -> str:
        best = self.record.best
        return (f"Sweep({self.run_dir!r}, trials={len(self.record.trials)}, "
                f"best_val_loss={best and best.val_loss})")

    @property
    def trials(self) -> pd.DataFrame:
        """One row per trial: its sampled settings (``optim.lr``, ...), ``val_loss`` (best
        reported), ``steps``, ``stopped_early``, ``error``, ``checkpoint_path``."""
        import pandas as pd

        return pd.DataFrame([{"trial_id": t.trial_id, **t.config, "val_loss": t.val_loss,
                              "steps": t.steps, "stopped_early": t.stopped_early,
                              "error": t.error, "checkpoint_path": t.checkpoint_path}
                             for t in self.record.trials])

    @property
    def curves(self) -> pd.DataFrame:
        """Every trial's validation curve: ``trial_id``, ``step``, ``val_loss``."""
        import pandas as pd

        return pd.DataFrame([{"trial_id": t.trial_id, "step": s, "val_loss": v}
                             for t in self.record.trials for s, v in t.history],
                            columns=["trial_id", "step", "val_loss"])

    @property
    def best(self) -> dict[str, Any] | None:
        """The best trial: ``trial_id``, ``config``, ``val_loss``, ``checkpoint_path``."""
        return self.summary["best"]

    @property
    def best_config(self) -> Config:
        """The sweep's config with the best trial's settings: train it with ``train``."""
        if self.best is None:
            raise ValueError(f"no trial of the sweep in {self.run_dir} reported a validation "
                             f"loss.")
        import yaml

        from raylm.config import config_from_dict

        return config_from_dict(yaml.safe_load(storage.read_text(
            storage.join(self.run_dir, "best.yaml"))))


def _connect(cfg: Config) -> None:
    from raylm.run.cluster import connect

    connect(cfg.run.ray_address, log=_say, timeout_s=cfg.run.connect_timeout_s)


def prepare(config: ConfigLike = None, *, overrides: Overrides = None,
            output: str | os.PathLike | None = None) -> dict[str, Any]:
    """Tokenize and pack ``data.source`` into ``output`` (Parquet blocks, ``layout.json`` and
    ``manifest.json``), or, without ``output``, into the cache that ``train`` with the same
    config reads (reused when it is there already). Returns the manifest, with ``directory``
    added: where the prepared data lies."""
    from raylm.console import quiet_libraries
    from raylm.contracts import PREPARED_MANIFEST
    from raylm.data.corpus import resolve_sources
    from raylm.data.preparation import prepare as run_prepare
    from raylm.data.preparation import prepared_dir
    from raylm.outputs import check_output

    cfg = resolve(config, overrides)
    d = cfg.data
    # A missing path, or an output that would damage the corpus, fails in a second, not after
    # Ray starts.
    files = resolve_sources(d.source, builtin_packages=d.builtin_packages, hf_split=d.hf_split)
    if output is not None:
        check_output(output, what="--output", marker=PREPARED_MANIFEST, key="fingerprint",
                     inputs=[("the source file", f.path) for f in files])
    _connect(cfg)
    quiet_libraries(cfg.run.verbose)
    if output is None:
        directory = prepared_dir(cfg, log=_say)
        manifest = json.loads((directory / PREPARED_MANIFEST).read_text())
    else:
        directory = Path(output).expanduser().resolve()
        manifest = run_prepare(cfg, directory, log=_say)
    return {**manifest, "directory": str(directory)}


def train(config: ConfigLike = None, *, overrides: Overrides = None) -> Run:
    """Train (or resume) the run ``run.name``; returns it once it has finished."""
    from raylm.run.launch import run_dir
    from raylm.run.launch import train as run_train
    from raylm.run.lease import hold
    from raylm.run.preflight import preflight
    from raylm.run.progress import use_bar

    checked = preflight(resolve(config, overrides))  # before Ray starts
    cfg = checked.cfg
    with hold(run_dir(cfg)):  # before Ray starts too
        _connect(cfg)
        run_train(cfg, log=_say, bar=use_bar(cfg.run.progress), checked=checked)
    return Run(run_dir(cfg))


def tune(config: ConfigLike = None, *, overrides: Overrides = None) -> Sweep:
    """Sweep (or resume the sweep) ``run.name``; returns it once every trial has ended."""
    from raylm.run.launch import run_dir
    from raylm.run.lease import hold
    from raylm.run.preflight import preflight
    from raylm.run.sweep import sweep

    checked = preflight(resolve(config, overrides), sweep=True)  # before Ray starts
    cfg = checked.cfg
    with hold(run_dir(cfg)):  # before Ray starts too
        _connect(cfg)
        sweep(cfg, log=_say, checked=checked)
    return Sweep(run_dir(cfg))


def _source(run: Run | str | os.PathLike) -> str:
    return run.run_dir if isinstance(run, Run) else str(run)


def export(run: Run | str | os.PathLike, output: str | os.PathLike, *, merge: bool = False,
           quantize: str | None = None, format: str = "hf", overwrite: bool = False) -> Path:
    """Write the run's newest checkpoint as a Hugging Face model directory (a peft adapter
    directory for LoRA runs unless ``merge``; int8 weight-only with ``quantize="int8"``), or
    with ``format="gguf"`` as a GGUF file llama.cpp runs (``quantize`` f16, q8_0 or f32).
    ``output`` must be new, empty, or an earlier export of the same kind (of any kind with
    ``overwrite``); it never holds the run or its base model."""
    from raylm.console import quiet_model_io
    from raylm.formats.exporter import export as run_export

    with quiet_model_io():
        return run_export(_source(run), output, merge=merge, quantize=quantize, format=format,
                          overwrite=overwrite, log=_say)


def prune(source: Run | str | os.PathLike, output: str | os.PathLike, *, sparsity: str | float,
          method: str = "wanda", data: str | os.PathLike | None = None,
          calibration_blocks: int = 32, overwrite: bool = False) -> dict[str, Any]:
    """A pruned copy of a run's model (or of a model directory, with ``data``: prepared data
    for wanda's calibration and the losses) in ``output`` (``raylm prune``): ``sparsity`` a
    fraction of each layer's weights, or ``"2:4"``; ``method`` ``"wanda"`` or
    ``"magnitude"``. Returns its report (each layer's sparsity, the validation loss before
    and after, the sizes), which ``output/raylm_export.json`` holds too."""
    from raylm.after.prune import prune_source
    from raylm.console import quiet_model_io

    with quiet_model_io():
        return prune_source(_source(source), output, sparsity_text=str(sparsity), method=method,
                            data=None if data is None else str(data),
                            calibration_blocks=calibration_blocks, overwrite=overwrite,
                            log=_say)


def generate(source: Run | str | os.PathLike, prompt: str = "", *, chat: str | None = None,
             system: str | None = None, max_new_tokens: int = 64, temperature: float = 0.8,
             seed: int = 0) -> str:
    """Sample a continuation of ``prompt`` (or, with ``chat``, the answer to that user
    message, after the ``system`` message if given) from a run or an exported model
    directory."""
    from raylm.console import quiet_model_io
    from raylm.formats.exporter import generate as run_generate

    with quiet_model_io():
        return run_generate(_source(source), prompt, chat=chat, system=system,
                            max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)


def evaluate(source: Run | str | os.PathLike, *, overrides: Overrides = None,
             step: int | None = None, every: bool = False) -> pd.DataFrame:
    """Benchmark scores (``raylm eval``) of a run's latest usable checkpoint, the one at
    ``step``, or ``every`` one, or of an exported model directory: one row per scored
    checkpoint (``step``, and ``eval/<task>/<metric>`` columns). ``overrides`` are ``eval.*``
    keys (``{"eval.tasks": ["arc_easy"]}``); without eval.tasks a run is scored on its own
    (its task folder given as eval.include_path). A run's scores join its record."""
    import pandas as pd

    from raylm.after.evaluate import evaluate_source

    other = [k for k in overrides or {} if not k.startswith("eval.")]
    if other:
        raise ValueError(f"evaluate takes eval.* overrides only, not {other[0]}: it scores "
                         f"what a run already trained.")
    ev = resolve(None, overrides).eval if overrides else None
    records = evaluate_source(_source(source), ev, step=step, every=every, log=_say)
    return pd.DataFrame([{"step": r.step, **(r.scores if isinstance(r, Benchmark)
                                              else {"error": r.error})} for r in records])


def shutdown() -> None:
    """Stop the local Ray cluster a call started (a joined cluster is only left)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
