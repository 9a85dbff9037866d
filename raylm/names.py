"""Names more than one process agrees on: the files of a prepared directory and of a run
directory, and the events workers report. Written and read in different places (Ray Data
tasks, workers, the controller, the driver, later commands), so they are defined once here.
"""

from enum import StrEnum

# A prepared directory (raylm.data.preparation writes it; workers and the driver read it).
PREPARED_MANIFEST = "manifest.json"   # counts, sources, tokenizer, fingerprint
LAYOUT = "layout.json"                # the packed blocks of each split
SPLITS = ("train", "val")             # one folder of block files each

# A reference directory (raylm.run.reference): per split, a file beside each block file with
# the same row groups, holding the starting model's log-probability of every trained target.
REFERENCE_INFO = "reference.json"     # what it was computed from, and when
REFERENCE_COLUMN = "ref_logp"         # its column, and the batches' key in the stream

# A run directory.
RUN_INFO = "run.json"                 # the run's config and tokenizer, for export and resume
SUMMARY = "summary.json"              # the run's figures; the controller's record writes it
EVENTS = "events.jsonl"               # the run's event log (local storage)
EVENT_SEGMENTS = "events"             # the event log as numbered objects (object storage)
MLFLOW_RUN = "mlflow_run.json"        # the MLflow run this run logs into
JOB_CONFIG = "raylm_job.yaml"         # the config a submitted job runs
LEASE = "lease.json"                  # who runs it now (raylm.run.lease)
SKIPPED = "skipped_samples.json"      # positions rewinds left out, bad checkpoints (workers)
TUNE_EXPERIMENT = "tune"              # a sweep's Ray Tune experiment (raylm.run.sweep)

# An exported model directory (raylm export): what it is, from which run and step.
EXPORT_INFO = "raylm_export.json"

# A checkpoint directory inside a run directory.
CHECKPOINT_MARKER = "raylm_checkpoint.json"   # present once the checkpoint is complete
CHECKPOINT_SAMPLES = "samples.npy"            # the per-sample ledger at the checkpoint

# The kinds of record in a run's events.jsonl, each its ``event`` (the name in lower case), and
# of the interruptions its summary lists (RESTART, RESIZE). A new worker group reports
# GROUP_START first; the controller's record writes the rest.
Event = StrEnum("Event", " ".join(("INVOCATION DEVICE SCHEDULE_MOVED RESUMED_WITH_CHANGES PLACING",
                                   "PLACED GROUP_START PROGRESS NUMERICAL_FAULT FAILURE RESTART",
                                   "RESIZE BENCHMARK BENCHMARK_FAILED WAITED_FOR_BENCHMARKS",
                                   "TRACKING_LOST END")), module=__name__)
# The key of a report that carries the reports a worker held back while the one before waited
# for the controller (raylm.workers.checkpoint.Checkpointer), oldest first.
EARLIER_REPORTS = "earlier_reports"
