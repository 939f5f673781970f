"""`kasoku batch`: one image per line of a JSONL file, in this process or on a Ray cluster.

The flow, each step one module:

    jobs.read_jobs (every line checked) → driver.prepare (sizes against the profile the engines
    will serve, the output folder; nothing heavy yet) → driver.drive with a runner (this process, or
    Ray actors: ray.run_ray) → output: <id>.png + results.jsonl

Nothing lost, nothing twice. An image is written under a temporary name and renamed into place;
its line in results.jsonl is appended (flushed and fsynced) only afterwards, and only by the
driver (this process), so the results file has a single writer. A job counts as done when its
image and a result line for the same job (same key) both exist, so re-running the same command
after an interruption finishes the rest and leaves one image and one line per job.

One of the apps (with cli and serve), the top layer. May import: every layer, and the other apps.
"""

from ..core.choices import DEFAULT_BATCH_SIZE
from .driver import BatchPlan, BatchResult, LocalRunner, drive, prepare, run_local
from .jobs import (
    DEFAULT_GUIDANCE,
    DEFAULT_STEPS,
    JOB_FIELDS,
    InvalidJobs,
    Job,
    call_arguments,
    call_key,
    check_jobs,
    parse_job,
    plan_batches,
    read_jobs,
    with_native_size,
)
from .output import RESULTS_FILE, STATE_DIR, BatchFailed, JobResult, OutputDir, OutputNotWritable, check_output_dir
from .ray import (
    LOCAL_RAY,
    RAY_EXTRA,
    RayNotInstalled,
    RayRunner,
    RayWorkerPool,
    check_fits,
    default_workers,
    import_ray,
    ray_session,
    run_ray,
)
from .worker import BatchWorker, PipelineRecipe, WorkerInfo, batch_profile, describe_backends, txt2img_components

__all__ = [
    "BatchFailed", "BatchPlan", "BatchResult", "BatchWorker", "DEFAULT_BATCH_SIZE", "DEFAULT_GUIDANCE",
    "DEFAULT_STEPS", "InvalidJobs", "JOB_FIELDS", "Job", "JobResult", "LOCAL_RAY", "LocalRunner", "OutputDir",
    "OutputNotWritable", "PipelineRecipe", "RAY_EXTRA", "RESULTS_FILE", "RayNotInstalled", "RayRunner",
    "RayWorkerPool", "STATE_DIR", "WorkerInfo", "batch_profile", "call_arguments", "call_key", "check_fits",
    "check_jobs", "check_output_dir",
    "default_workers", "describe_backends", "drive", "import_ray", "parse_job", "plan_batches", "prepare",
    "ray_session", "read_jobs", "run_local", "run_ray", "txt2img_components", "with_native_size",
]
