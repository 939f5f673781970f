"""`kasoku generate` (one call) and `kasoku batch` (a JSONL file of jobs, here or on Ray)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import time
import warnings
from pathlib import Path
from typing import Any

from ..core.errors import KasokuError
from .base import (
    IMAGE_SUFFIXES,
    Command,
    add_backend_arguments,
    add_cache_branch,
    add_cache_dir,
    add_controlnet,
    add_engine_arguments,
    add_ip_adapter_arguments,
    add_json,
    add_lora_targets,
    add_model,
    add_recipe,
    add_step_cache_arguments,
    add_tiny_vae,
    check_backend,
    check_output_file,
    check_recipe_arguments,
    controlnets_from_args,
    finite_float,
    flags_named,
    fraction,
    ip_adapters_from_args,
    load_ip_adapters,
    lora_spec,
    open_image,
    options_from_args,
    positive_int,
    seed,
    show_stage,
    size_range,
    step_caching_from_args,
    text,
    tiny_vae_from_args,
)


class Generate(Command):
    """Generate images (txt2img, img2img with --image, inpaint with --image and --mask), steered by ControlNets
    with --controlnet and --control-image."""

    name = "generate"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ..core.schedulers import SCHEDULERS

        add_model(p)
        p.add_argument("prompt", type=text, help="what to draw")
        p.add_argument("-o", "--output", type=Path, default=Path("out.png"),
                       help="image file (default out.png; out-0.png, out-1.png, ... for several)")
        p.add_argument("--negative", type=text, default=None, help="negative prompt")
        p.add_argument("--prompt-2", type=text, default=None,
                       help="SDXL, SD3, Flux: the prompt for the second text encoder (default: PROMPT)")
        p.add_argument("--negative-2", type=text, default=None,
                       help="SDXL, SD3: the negative prompt for the second text encoder")
        p.add_argument("--prompt-3", type=text, default=None, help="SD3: the prompt for T5 (default: PROMPT)")
        p.add_argument("--steps", type=positive_int, default=None,
                       help="denoising steps (default: the family's, 30 for SD 1.x/2.x/XL, 28 for SD3 and Flux; with "
                            "a few-step scheduler its models', 1 for euler(-ancestral)-trailing (Turbo), 4 for lcm "
                            "and tcd)")
        p.add_argument("--guidance", type=finite_float, default=None,
                       help="guidance scale (default: the family's, 7.5 for SD 1.x/2.x/XL, 7.0 for SD3; Flux "
                            "embeds 3.5, which is no classifier-free guidance; with a few-step scheduler 0, or 1 for "
                            "lcm, 8 for an LCM-distilled U-Net). At 1 or less the engines run no guidance: one "
                            "denoiser row per image")
        p.add_argument("--true-cfg", type=finite_float, default=None, metavar="S",
                       help="Flux: classifier-free guidance at scale S with --negative (two transformer calls a step)")
        p.add_argument("--seed", type=seed, default=0, help="generator seed, 0..2**63-1 (default 0)")
        p.add_argument("--num-images", type=positive_int, default=1, help="images per prompt (default 1)")
        p.add_argument("--height", type=positive_int, default=None,
                       help="image height in pixels, a multiple of the model's size step (8 x 2^levels for a "
                            "U-Net: 16 for the tiny SD, 64 for SD 1.5; 16 for SD3 and Flux; default: the model's "
                            "native)")
        p.add_argument("--width", type=positive_int, default=None,
                       help="image width in pixels, a multiple of the model's size step (8 x 2^levels for a "
                            "U-Net: 16 for the tiny SD, 64 for SD 1.5; 16 for SD3 and Flux; default: the model's "
                            "native)")
        p.add_argument("--image", type=Path, help="img2img / inpaint: the input image")
        p.add_argument("--strength", type=fraction, default=None,
                       help="img2img / inpaint strength in [0, 1] (default 0.8)")
        p.add_argument("--mask", type=Path, help="inpaint: white where to paint")
        p.add_argument("--scheduler", choices=list(SCHEDULERS), default=None,
                       help="swap the model's scheduler (default: keep it); lcm, tcd and the -trailing ones are the "
                            "few-step models' (LCM, TCD, Turbo, Lightning, Hyper-SD)")
        add_controlnet(p)
        add_tiny_vae(p)
        add_ip_adapter_arguments(p)
        p.add_argument("--control-image", action="append", type=Path, default=None, metavar="IMG",
                       help="the control image of a --controlnet (one per --controlnet, in the same order), of the "
                            "generated image's size")
        p.add_argument("--control-scale", action="append", type=finite_float, default=None, metavar="S",
                       help="controlnet_conditioning_scale: one for every ControlNet, or one per --controlnet "
                            "(default: diffusers', 1.0; 0.8 for img2img)")
        p.add_argument("--guess-mode", action="store_true",
                       help="ControlNet guess mode: the ControlNet sees the conditional half of the batch only")
        p.add_argument("--lora", type=lora_spec, action="append", default=[], metavar="PATH[:SCALE]",
                       help="a LoRA adapter (a diffusers, kohya or PEFT .safetensors file, or its folder) at weight "
                            "SCALE (default 1); repeat to blend several")
        add_engine_arguments(p, profile_flags=False)
        add_recipe(p)
        add_step_cache_arguments(p, per_call=True)

    def run(self, args: argparse.Namespace) -> int:
        output = check_output_file(args.output, suffixes=IMAGE_SUFFIXES)
        image = open_image(args.image, "--image") if args.image else None
        mask = open_image(args.mask, "--mask").convert("L") if args.mask else None
        if mask is not None and image is None:
            raise KasokuError("--mask needs --image (the picture to inpaint).")
        if args.strength is not None and image is None:
            raise KasokuError("--strength needs --image (how far img2img and inpainting move from it).")
        controls = _control_images(args)
        ip_adapters, ip_images, ip_scales = ip_adapters_from_args(args)
        # the profile (and with it --cuda-graph, which needs an exact one) is chosen below, for this call
        options = options_from_args(args, cuda_graph=False)
        if args.cuda_graph:
            check_backend(options, cuda_graph=True)

        _check_from_configs(args)
        # the model's own modules (diffusers and the engines' runtimes): imported once the arguments pass
        from ..core.console import console, steps_bar, table
        from ..core.schedulers import scheduler_named
        from ..core.step_cache import StepCaching
        from ..model.pipeline_model import Model
        from ..pipeline.checks import CallChecks, PromptTruncated, check_size, task_of
        from ..pipeline.kasoku_pipeline import compile
        from ..runtime.lora import check_adapter_file

        start = time.perf_counter()
        # configs only: weights load only for what must be built
        reference = Model.load(args.model, lazy=True, controlnet=controlnets_from_args(args),
                               tiny_vae=tiny_vae_from_args(args), label=str(args.model))
        native = reference.native_size
        # before a compile that could take minutes
        check_size(args.height or native, args.width or native, reference.pixel_multiple)
        shape = _call_shape(args, image or (controls[0] if controls else None), reference)
        if controls:
            from ..pipeline.checks import check_control_images

            check_control_images(controls, 1, shape.height, shape.width)
        for path, _scale in args.lora:
            check_adapter_file(path, reference, "--lora")
        scheduler = scheduler_named(args.scheduler, reference.scheduler) if args.scheduler else reference.scheduler
        steps, guidance = reference.command_defaults(scheduler)  # a few-step scheduler's, else the family's
        args.steps = args.steps or steps
        args.guidance = guidance if args.guidance is None else args.guidance
        options = _engines_for(args, shape, reference, options).replace(cuda_graph=args.cuda_graph)
        kwargs = _call_arguments(args, image, mask, controls)
        if "use_resolution_binning" in inspect.signature(type(reference.pipe).__call__).parameters:
            kwargs["use_resolution_binning"] = False  # engines are built for the size asked; binning renders another
        planned = {*reference.components, *reference.family.step_cache_components}
        with flags_named():  # every argument checked before a compile that can take minutes
            checks = CallChecks(reference, options.profile, planned, scheduler=lambda: scheduler)
            checks.check(task_of(image, mask), args.prompt, **kwargs)
            caching = checks.step_caching({n: kwargs[n] for n in StepCaching.ARGUMENTS if n in kwargs})
        options = options.replace(step_cache=options.step_cache or bool(caching.graphs))
        for note in checks.truncation_notes(args.prompt, kwargs):
            console.print(f"note: {note}", markup=False)
        pipe = compile(reference, options=options, on_stage=show_stage, label=str(args.model))
        if args.lora:
            names = [f"lora{i}" for i in range(len(args.lora))]
            for name, (path, _scale) in zip(names, args.lora):
                pipe.load_lora_weights(str(path), adapter_name=name)
            pipe.set_adapters(names, [scale for _path, scale in args.lora])
        load_ip_adapters(pipe, args, ip_adapters, ip_scales)
        if ip_images:
            kwargs["ip_adapter_image"] = ip_images if len(ip_images) > 1 else ip_images[0]
        load_seconds = time.perf_counter() - start
        if args.scheduler:
            pipe.scheduler = scheduler
        pipe.times.reset()
        with steps_bar() as bar:
            task = bar.add_task("denoising", total=None)

            def on_step(_pipe, step, _timestep, callback_kwargs):
                bar.update(task, completed=step + 1, total=_pipe.num_timesteps)
                return callback_kwargs

            def on_step_legacy(step, _timestep, _latents):  # pipelines older than callback_on_step_end (PixArt's)
                bar.update(task, completed=step + 1, total=kwargs.get("num_inference_steps"))

            takes = inspect.signature(pipe.__call__).parameters
            progress = {"callback_on_step_end": on_step} if "callback_on_step_end" in takes else \
                {"callback": on_step_legacy, "callback_steps": 1} if "callback" in takes else {}
            start = time.perf_counter()
            with flags_named(), warnings.catch_warnings():
                warnings.simplefilter("ignore", PromptTruncated)  # said above, before the compile
                images = pipe(args.prompt, **progress, **kwargs).images
            call_seconds = time.perf_counter() - start
        paths = [output] if len(images) == 1 else [output.with_name(f"{output.stem}-{i}{output.suffix}")
                                                   for i in range(len(images))]
        for img, path in zip(images, paths):
            img.save(path)
        extras = "".join(f" + {what}" for what, given in (("LoRA", args.lora), ("IP-Adapter", ip_adapters)) if given)
        rows = [["compile / load engines" + extras, f"{load_seconds:.2f} s", ""]]
        rows += [[name, f"{pipe.times.seconds[name]:.2f} s", f"{pipe.times.calls[name]} calls"]
                 for name in pipe.times.seconds]
        rows.append(["whole call", f"{call_seconds:.2f} s", pipe.task(image, mask)])
        console.print(table("time per stage", ["stage", "time", ""], rows))
        console.print("backends: " + ", ".join(f"{n}={b}" for n, b in pipe.compile_report.backends.items()))
        for note in pipe.compile_report.notes:
            console.print(f"note: {note}", markup=False)
        console.print("wrote " + ", ".join(str(p) for p in paths))
        return 0


def _check_from_configs(args: argparse.Namespace) -> None:
    """What the folder's configs alone decide, before diffusers is imported: the size step and the family's own
    arguments (a hub id or a family compiled from recorded calls is checked once the model is loaded)."""
    from ..model.preview import ConfigPreview
    from ..pipeline.checks import check_bound, check_family_arguments, check_size

    preview = ConfigPreview.of(args.model)
    if preview is None:
        return
    height, width = args.height or preview.native_size, args.width or preview.native_size
    check_size(height, width, preview.pixel_multiple)
    check_bound(preview, height, width)
    with flags_named():
        check_family_arguments(preview.family, dict(_family_arguments(args)))


def _family_arguments(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The call arguments some families alone take, as given (left out when not: the class's own default)."""
    return [(k, v) for k, v in (("negative_prompt", args.negative), ("prompt_2", args.prompt_2),
                                ("negative_prompt_2", args.negative_2), ("prompt_3", args.prompt_3),
                                ("true_cfg_scale", args.true_cfg)) if v]


def _call_arguments(args: argparse.Namespace, image, mask, controls: list) -> dict:
    """The pipeline call of `kasoku generate`, in diffusers' names (steps and guidance filled in by `run`)."""
    import torch

    kwargs = dict(num_inference_steps=args.steps,
                  guidance_scale=args.guidance, num_images_per_prompt=args.num_images, height=args.height,
                  width=args.width, generator=torch.Generator().manual_seed(args.seed),
                  **step_caching_from_args(args))
    # left out when not given: the class's own default (PixArt's negative prompt is "", and None breaks it)
    kwargs.update(_family_arguments(args))
    if image is not None:
        kwargs.update(image=image, strength=0.8 if args.strength is None else args.strength)
    if mask is not None:
        kwargs["mask_image"] = mask
    if controls:
        kwargs["control_image"] = controls[0] if len(controls) == 1 else controls
        if args.guess_mode:  # SD3's ControlNet pipeline has no guess mode: the checks refuse it there, by name
            kwargs["guess_mode"] = True
        if args.control_scale:
            kwargs["controlnet_conditioning_scale"] = args.control_scale[0] if len(args.control_scale) == 1 \
                else args.control_scale
    return kwargs


def _control_images(args: argparse.Namespace) -> list:
    """The --control-image files, one per --controlnet, and a --control-scale for all or for each."""
    controlnets = len(args.controlnet or ())
    images = args.control_image or []
    if not controlnets:
        given = [flag for flag, value in (("--control-image", images), ("--control-scale", args.control_scale),
                                          ("--guess-mode", args.guess_mode)) if value]
        if given:
            raise KasokuError(f"{given[0]} needs --controlnet PATH (the ControlNet it steers).")
        return []
    if len(images) != controlnets:
        raise KasokuError(f"give one --control-image per --controlnet: {controlnets} ControlNet"
                          f"{'s' if controlnets > 1 else ''} but {len(images)} control image"
                          f"{'s' if len(images) != 1 else ''}.")
    scales = args.control_scale or []
    if len(scales) not in (0, 1, controlnets):
        raise KasokuError(f"give one --control-scale for every ControlNet or one per --controlnet ({controlnets}) "
                          f"but {len(scales)} are given.")
    return [open_image(path, "--control-image") for path in images]


def _call_shape(args: argparse.Namespace, image, pipe):
    """The images, height and width this call generates: --height/--width, else the size of the input image
    (or of the first control image), else the model's native size."""
    from ..core.components import ImageShape

    base = pipe.default_profile()
    height = args.height or (image.size[1] if image else base.opt.height)
    width = args.width or (image.size[0] if image else base.opt.width)
    if height % base.multiple or width % base.multiple:
        raise KasokuError(f"--height and --width must be multiples of {base.multiple} for this model (the VAE's 8x "
                          f"times the U-Net's downsampling) but are {height} and {width}.")
    return ImageShape(args.num_images, height, width)


def _engines_for(args: argparse.Namespace, shape, pipe, options):
    """The options of the engines `generate` runs: engines already in the cache that serve this call (built for the
    exact shape, or for the model's default range; with the `auto` backend, also those `kasoku compile --backend X`
    built), else exact-shape engines for this call's size, image count and guidance (static shapes: faster on CPU
    backends, see the README), built where the cache is writable."""
    from ..build.compiler import cached_options
    from ..core.components import ShapeProfile

    base = dataclasses.replace(pipe.default_profile(), text_tokens=args.text_tokens)
    guided = pipe.doubles_batch({"guidance_scale": args.guidance})
    exact = ShapeProfile.exact(shape, guidance=guided, multiple=base.multiple, text_tokens=args.text_tokens)
    if args.cuda_graph:  # a CUDA graph replays one shape: exact-shape engines only
        return options.replace(profile=exact)
    served = [p for p in (exact, base) if p.serves(shape, guided)]
    return cached_options(pipe, options, served) or options.replace(profile=exact)


class Batch(Command):
    """Generate one image per line of a JSONL file, in this process or on a Ray cluster (--ray).

    Each line is one job: {"prompt": "...", "negative_prompt": "...", "seed": 1, "steps": 30, "guidance": 7.5,
    "height": 512, "width": 512, "id": "cat-1", "loras": ["style.safetensors:0.8"], "cache_interval": 3}; only
    prompt is required (seed and id default to the line number, the size to the model's; loras are
    PATH[:SCALE] strings or {"path": ..., "scale": ...} objects, and jobs with the same adapters share calls;
    cache_interval defaults to 1, no step caching, and a job's above 1 runs the model's step caching, with
    cache_schedule "uniform" or "nonuniform" for DeepCache; cache_method names another, and cache_threshold runs a
    transformer's first-block cache). With --controlnet, each job also gives "control_image" (a file,
    or a list with one per ControlNet, relative to the JSONL file's folder) and may give "control_scale" (a
    number, or one per ControlNet). DIR gets <id>.png per job and results.jsonl (one line per job). Every line
    and size is checked before any work starts; running the same command again after an interruption does
    only the jobs that are not done.
    """

    name = "batch"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_model(p)
        p.add_argument("prompts", type=Path, metavar="PROMPTS.jsonl",
                       help="one job per line: prompt, negative_prompt, seed, steps, guidance, height, width, id, "
                            "control_image, control_scale, loras, cache_interval, cache_schedule, cache_method, "
                            "cache_threshold")
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
                            "steps, guidance, step caching and whether they have a negative prompt")
        p.add_argument("--gpus-per-worker", type=_non_negative_float, default=0.0,
                       help="with --ray: GPUs Ray gives each worker, e.g. 1 for GPU backends (default 0)")
        p.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads per engine, and the CPUs Ray reserves per worker (default: the "
                            "runtime's; 1 with --ray)")
        add_controlnet(p)
        add_backend_arguments(p)
        add_recipe(p)
        p.add_argument("--height", type=size_range, metavar="MIN:MAX",
                       help="image heights the engines serve (default: half to double the model's size)")
        p.add_argument("--width", type=size_range, metavar="MIN:MAX",
                       help="image widths the engines serve (default: half to double the model's size)")
        add_lora_targets(p)
        add_cache_branch(p)
        add_cache_dir(p)
        add_json(p, "the run's summary")

    def run(self, args: argparse.Namespace) -> int:
        from ..batch import import_ray, prepare, read_jobs, run_local, run_ray
        from ..core.console import console, table, write_json
        from ..core.options import CompileOptions

        if args.ray is None and (args.workers not in (None, 1) or args.gpus_per_worker):
            raise KasokuError("--workers and --gpus-per-worker need --ray (without it, the jobs run in this "
                              "process).")
        if args.ray is not None:
            import_ray()  # a missing extra is the first thing to say
        threads = args.threads or (1 if args.ray is not None else None)  # Ray: one CPU per worker unless asked
        jobs = read_jobs(args.prompts)
        # jobs with adapters switch them between batches: by default the attention projections are run-time weights
        targets = args.lora_targets if args.lora_targets is not None else \
            ("attention" if any(job.loras for job in jobs) else ())
        options = CompileOptions(backend=args.backend, precision=args.precision, min_psnr=args.min_psnr,
                                 cache_dir=args.cache_dir, threads=threads, lora_targets=targets,
                                 int8_activations=args.int8_activations, int4_weights=args.int4_weights,
                                 cache_branch=args.cache_branch,
                                 recipe=args.recipe)
        check_recipe_arguments(args)
        check_backend(options)
        plan = prepare(args.model, jobs, args.out, batch_size=args.batch_size, controlnet=controlnets_from_args(args),
                       options=options, height=args.height, width=args.width)
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

    from ..core.console import console

    class ImagesPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            elapsed = task.elapsed or 0.0
            rate = task.completed / elapsed if elapsed > 0 and task.completed else None
            return Text(f"{rate:.2f} img/s" if rate else "- img/s")

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("jobs"),
                    ImagesPerSecond(), TextColumn("ETA"), TimeRemainingColumn(), console=console)
