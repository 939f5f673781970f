"""`kasoku generate` (one call) and `kasoku batch` (a JSONL file of jobs, here or on Ray)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..errors import KasokuError
from .base import (
    Command,
    add_backend_arguments,
    add_cache_dir,
    add_engine_arguments,
    add_json,
    add_model,
    check_backend,
    check_output_file,
    finite_float,
    fraction,
    non_negative_int,
    open_image,
    options_from_args,
    positive_int,
    show_stage,
    size_range,
)


class Generate(Command):
    """Generate images (txt2img, img2img with --image, inpaint with --image and --mask)."""

    name = "generate"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ..schedulers import SCHEDULERS

        add_model(p)
        p.add_argument("prompt", help="what to draw")
        p.add_argument("-o", "--output", type=Path, default=Path("out.png"),
                       help="image file (default out.png; out-0.png, out-1.png, ... for several)")
        p.add_argument("--negative", default=None, help="negative prompt")
        p.add_argument("--prompt-2", default=None,
                       help="SDXL: the prompt for the second text encoder (default: PROMPT)")
        p.add_argument("--negative-2", default=None, help="SDXL: the negative prompt for the second text encoder")
        p.add_argument("--steps", type=positive_int, default=30, help="denoising steps (default 30)")
        p.add_argument("--guidance", type=finite_float, default=7.5,
                       help="classifier-free guidance scale (default 7.5)")
        p.add_argument("--seed", type=non_negative_int, default=0, help="generator seed (default 0)")
        p.add_argument("--num-images", type=positive_int, default=1, help="images per prompt (default 1)")
        p.add_argument("--height", type=positive_int, default=None,
                       help="image height in pixels, a multiple of 8 (default: the model's native)")
        p.add_argument("--width", type=positive_int, default=None,
                       help="image width in pixels, a multiple of 8 (default: the model's native)")
        p.add_argument("--image", type=Path, help="img2img / inpaint: the input image")
        p.add_argument("--strength", type=fraction, default=0.8,
                       help="img2img / inpaint strength in [0, 1] (default 0.8)")
        p.add_argument("--mask", type=Path, help="inpaint: white where to paint")
        p.add_argument("--scheduler", choices=list(SCHEDULERS), default=None,
                       help="swap the model's scheduler (default: keep it)")
        add_engine_arguments(p, profile_flags=False)

    def run(self, args: argparse.Namespace) -> int:
        import torch

        from ..components import native_size
        from ..console import console, steps_bar, table
        from ..loading import load_pipeline
        from ..pipeline import check_size, compile

        output = check_output_file(args.output)
        image = open_image(args.image, "--image") if args.image else None
        mask = open_image(args.mask, "--mask").convert("L") if args.mask else None
        if mask is not None and image is None:
            raise KasokuError("--mask needs --image (the picture to inpaint).")
        # the profile (and with it --cuda-graph, which needs an exact one) is chosen below, for this call
        options = options_from_args(args, cuda_graph=False)
        if args.cuda_graph:
            check_backend(options, cuda_graph=True)

        start = time.perf_counter()
        reference = load_pipeline(args.model, lazy=True)  # configs only: weights load only for what must be built
        native = native_size(reference)
        check_size(args.height or native, args.width or native)  # before a compile that could take minutes
        options = options.replace(profile=_profile_for(args, image, reference, options), cuda_graph=args.cuda_graph)
        pipe = compile(reference, options=options, on_stage=show_stage, label=str(args.model))
        load_seconds = time.perf_counter() - start
        if args.scheduler:
            pipe.set_scheduler(args.scheduler)
        kwargs = dict(negative_prompt=args.negative, num_inference_steps=args.steps, guidance_scale=args.guidance,
                      num_images_per_prompt=args.num_images, height=args.height, width=args.width,
                      generator=torch.Generator().manual_seed(args.seed))
        kwargs.update({k: v for k, v in (("prompt_2", args.prompt_2), ("negative_prompt_2", args.negative_2)) if v})
        if image is not None:
            kwargs.update(image=image, strength=args.strength)
        if mask is not None:
            kwargs["mask_image"] = mask
        pipe.times.reset()
        with steps_bar() as bar:
            task = bar.add_task("denoising", total=None)

            def on_step(_pipe, step, _timestep, callback_kwargs):
                bar.update(task, completed=step + 1, total=_pipe.num_timesteps)
                return callback_kwargs

            start = time.perf_counter()
            images = pipe(args.prompt, callback_on_step_end=on_step, **kwargs).images
            call_seconds = time.perf_counter() - start
        paths = [output] if len(images) == 1 else [output.with_name(f"{output.stem}-{i}{output.suffix}")
                                                   for i in range(len(images))]
        for img, path in zip(images, paths):
            img.save(path)
        rows = [["compile / load engines", f"{load_seconds:.2f} s", ""]]
        rows += [[name, f"{pipe.times.seconds[name]:.2f} s", f"{pipe.times.calls[name]} calls"]
                 for name in pipe.times.seconds]
        rows.append(["whole call", f"{call_seconds:.2f} s", pipe.task(image, mask)])
        console.print(table("time per stage", ["stage", "time", ""], rows))
        console.print("backends: " + ", ".join(f"{n}={b}" for n, b in pipe.compile_report.backends.items()))
        for note in pipe.compile_report.notes:
            console.print(f"note: {note}", markup=False)
        console.print("wrote " + ", ".join(str(p) for p in paths))
        return 0


def _profile_for(args: argparse.Namespace, image, pipe, options):
    """What `generate` compiles for: engines already in the cache that serve this call (built for the
    exact shape, or for the model's default range), else exact-shape engines for this call's size,
    image count and guidance (static shapes: faster on CPU backends, see the README)."""
    from ..build import cached_profile
    from ..components import ImageShape, ShapeProfile, default_profile

    base = default_profile(pipe)
    height = args.height or (image.size[1] if image else base.opt.height)
    width = args.width or (image.size[0] if image else base.opt.width)
    if height % base.multiple or width % base.multiple:
        raise KasokuError(f"--height and --width must be multiples of {base.multiple} for this model (the VAE's 8x "
                          f"times the U-Net's downsampling) but are {height} and {width}.")
    shape = ImageShape(args.num_images, height, width)
    exact = ShapeProfile.exact(shape, guidance=args.guidance > 1, multiple=base.multiple)
    if args.cuda_graph:  # a CUDA graph replays one shape: exact-shape engines only
        return exact
    served = [p for p in (exact, base) if p.serves(shape, args.guidance > 1)]
    return cached_profile(args.model, options, served) or exact


class Batch(Command):
    """Generate one image per line of a JSONL file, in this process or on a Ray cluster (--ray).

    Each line is one job: {"prompt": "...", "negative_prompt": "...", "seed": 1, "steps": 30, "guidance": 7.5,
    "height": 512, "width": 512, "id": "cat-1"}; only prompt is required (seed and id default to the line
    number, the size to the model's). DIR gets <id>.png per job and results.jsonl (one line per job). Every
    line and size is checked before any work starts; running the same command again after an interruption
    does only the jobs that are not done.
    """

    name = "batch"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_model(p)
        p.add_argument("prompts", type=Path, metavar="PROMPTS.jsonl",
                       help="one job per line: prompt, negative_prompt, seed, steps, guidance, height, width, id")
        p.add_argument("--out", type=Path, required=True, metavar="DIR",
                       help="folder for <id>.png per job and results.jsonl (created if missing; jobs already "
                            "there are skipped)")
        p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       help="run on Ray workers (needs kasoku[ray]): alone, a Ray instance started on this "
                            "machine; with ADDRESS (auto, ray://HEAD:10001, HEAD:6379) that cluster, whose nodes "
                            "must have kasoku and see DIR, the model and --cache-dir at the same paths")
        p.add_argument("--workers", type=positive_int, default=None,
                       help="with --ray: workers, each holding one pipeline (default: as many as the cluster's "
                            "CPUs, or GPUs with --gpus-per-worker, hold)")
        p.add_argument("--batch-size", type=positive_int, default=4,
                       help="images per engine call (default 4); jobs batch together when they share size, "
                            "steps, guidance and whether they have a negative prompt")
        p.add_argument("--gpus-per-worker", type=_non_negative_float, default=0.0,
                       help="with --ray: GPUs Ray gives each worker, e.g. 1 for GPU backends (default 0)")
        p.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads per engine, and the CPUs Ray reserves per worker (default: the "
                            "runtime's; 1 with --ray)")
        add_backend_arguments(p)
        p.add_argument("--height", type=size_range, metavar="MIN:MAX",
                       help="image heights the engines serve (default: half to double the model's size)")
        p.add_argument("--width", type=size_range, metavar="MIN:MAX",
                       help="image widths the engines serve (default: half to double the model's size)")
        add_cache_dir(p)
        add_json(p, "the run's summary")

    def run(self, args: argparse.Namespace) -> int:
        from ..batch import import_ray, prepare, read_jobs, run_local, run_ray
        from ..console import console, table, write_json
        from ..options import CompileOptions

        if args.ray is None and (args.workers not in (None, 1) or args.gpus_per_worker):
            raise KasokuError("--workers and --gpus-per-worker need --ray (without it, the jobs run in this "
                              "process).")
        if args.ray is not None:
            import_ray()  # a missing extra is the first thing to say
        threads = args.threads or (1 if args.ray is not None else None)  # Ray: one CPU per worker unless asked
        options = CompileOptions(backend=args.backend, precision=args.precision, min_psnr=args.min_psnr,
                                 cache_dir=args.cache_dir,
                                 threads=threads)
        check_backend(options)
        jobs = read_jobs(args.prompts)
        plan = prepare(args.model, jobs, args.out, batch_size=args.batch_size, options=options, height=args.height,
                       width=args.width)
        bar = _batch_bar()
        task = bar.add_task("generating", total=None, start=False)

        def on_start(todo: int, skipped: int) -> None:
            if skipped:
                console.print(f"{skipped} of {len(plan.jobs)} jobs already done in {plan.out_dir}; "
                              f"doing the other {todo}")
            bar.update(task, total=todo)
            bar.start()
            bar.start_task(task)

        hooks = dict(on_start=on_start, on_result=lambda _result: bar.advance(task), on_stage=show_stage)
        try:
            if args.ray is None:
                result = run_local(plan, **hooks)
            else:
                result = run_ray(plan, address=args.ray, workers=args.workers,
                                 gpus_per_worker=args.gpus_per_worker, **hooks)
        finally:
            bar.stop()
        rows = [["jobs", f"{result.jobs} ({result.skipped} already done, {result.generated} generated)"],
                ["time generating", f"{result.seconds:.2f} s"],
                ["images/s", f"{result.images_per_second:.2f}"],
                ["backend", result.backend or "-"],
                ["batch size", result.batch_size]]
        rows += [[f"worker {w.name}", _worker_startup(w)] for w in result.workers]
        if result.retried_batches:
            rows.append(["retried", f"{result.retried_batches} batches whose worker died; "
                                    f"{len(result.worker_restarts)} workers restarted"])
        console.print(table(f"batch ({result.mode})", ["", "value"], rows))
        console.print(f"images and {Path(result.results_file).name} in {result.out_dir}")
        if args.json:
            write_json(args.json, result)
        return 0


def _non_negative_float(text: str) -> float:
    from .base import _number

    return _number(float, text, "a number >= 0", lambda v: v >= 0)


def _worker_startup(worker) -> str:
    ready = f"ready in {worker.startup_seconds:.1f} s: " if worker.startup_seconds is not None else ""
    return (f"{ready}imports {worker.import_seconds:.1f} s, model {worker.model_seconds:.1f} s, "
            f"engines {'built and loaded' if worker.built_stages else 'from the cache'} {worker.engine_seconds:.1f} s")


def _batch_bar():
    """Jobs done of the total, images per second since the start, and the time left."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    from ..console import console

    class ImagesPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            elapsed = task.elapsed or 0.0
            rate = task.completed / elapsed if elapsed > 0 and task.completed else None
            return Text(f"{rate:.2f} img/s" if rate else "- img/s")

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("jobs"),
                    ImagesPerSecond(), TextColumn("ETA"), TimeRemainingColumn(), console=console)
