"""`kasoku`: compile diffusers Stable Diffusion pipelines into fast engines, and prove them.

Every command is a thin layer over a library call that returns data; this module only parses
arguments and prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .errors import KasokuError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = fn
        return fn

    return register


# ---- commands --------------------------------------------------------------------------------


@command("tiny")
def cmd_tiny(args: argparse.Namespace) -> int:
    """Write a built-in tiny Stable Diffusion pipeline (SD 1.x, 2.x or XL) as a diffusers folder."""
    from .console import console
    from .families import FAMILIES
    from .tiny import write_tiny_pipeline

    path = write_tiny_pipeline(args.dir, family=args.family, inpainting=args.inpainting,
                               prediction=args.prediction, seed=args.seed)
    kind = "inpainting " if args.inpainting else ""
    console.print(f"wrote the tiny {FAMILIES[args.family].title} {kind}pipeline ({args.prediction}, seed {args.seed}) "
                  f"to {path}")
    return 0


@command("export")
def cmd_export(args: argparse.Namespace) -> int:
    """Export a pipeline's components to ONNX, with a parity check against torch."""
    from .console import console, stage, table, write_json
    from .export import export_pipeline

    with stage(f"exporting {args.model} ({args.exporter}, opset {args.opset})"):
        manifest = export_pipeline(
            args.model,
            args.outdir,
            components=args.components,
            exporter=args.exporter,
            opset=args.opset,
        )
    rows = []
    for c in manifest.components:
        worst = max(c.parity, key=lambda p: p.max_abs / p.limit)
        rows.append(
            [c.name, c.path, f"{c.size_bytes / 1e6:.1f} MB", f"{c.seconds:.1f} s",
             f"{worst.max_abs:.1e} (tol {worst.limit:.0e})", len({p.shape for p in c.parity})]
        )
    console.print(
        table("ONNX export", ["component", "file", "size", "time", "worst max|Δ| vs torch", "shapes checked"], rows)
    )
    console.print(f"manifest: {Path(args.outdir) / 'manifest.json'}")
    if args.json:
        write_json(args.json, manifest)
    return 0


@command("compile")
def cmd_compile(args: argparse.Namespace) -> int:
    """Build the engines of every component into the cache (export, optimize, engine)."""
    from .build import compile_components
    from .console import console, table, write_json
    from .families import FAMILIES


    _, report = compile_components(
        args.model, backend=args.backend, precision=args.precision, profile=_profile_from_args(args),
        components=args.components, cache=args.cache_dir, exporter=args.exporter, opset=args.opset,
        options=_engine_options(args), on_stage=_show_stage,
    )
    rows = [[s.component, s.stage, s.status, f"{s.seconds:.1f} s", s.key[:12]] for s in report.stages]
    console.print(table(f"compile {report.model} ({FAMILIES[report.family].title}, {report.precision})",
                        ["component", "stage", "cache", "time", "entry"], rows))
    for note in report.notes:
        console.print(f"note: {note}", markup=False)
    console.print("backends: " + ", ".join(f"{c}={b}" for c, b in report.backends.items()))
    built = sum(s.status != "reused" for s in report.stages)
    console.print(f"{built} built, {len(report.stages) - built} reused from the cache, {report.seconds:.1f} s in all")
    if args.json:
        write_json(args.json, report)
    return 0


@command("cache")
def cmd_cache(args: argparse.Namespace) -> int:
    """List (`ls`) or remove (`clear [MODEL]`) the cache entries."""
    import datetime

    from .cache import Cache
    from .console import console, table, write_json

    cache = Cache(args.cache_dir)
    if args.action == "clear":
        removed = cache.clear(args.model)
        console.print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {cache.root}")
        return 0
    entries = cache.list()
    rows = [[e.key[:12], e.kind, e.model, e.component, f"{e.size_bytes / 1e6:.1f} MB",
             datetime.datetime.fromtimestamp(e.created).strftime("%Y-%m-%d %H:%M")] for e in entries]
    console.print(table(f"cache {cache.root}", ["entry", "kind", "model", "component", "size", "created"], rows))
    console.print(f"{len(entries)} entries, {sum(e.size_bytes for e in entries) / 1e6:.1f} MB")
    if args.json:
        write_json(args.json, [vars(e) for e in entries])
    return 0


@command("info")
def cmd_info(args: argparse.Namespace) -> int:
    """Installed backends, versions and devices, and why a backend is unavailable."""
    from .console import console, table, write_json
    from .info import system_info

    info = system_info()
    machine = info["machine"]
    console.print(f"python {info['python']} | CPU: {machine['cpu']} ({machine['cores']} threads) | "
                  f"GPUs: {', '.join(machine['gpus']) or 'none'}")
    console.print(table("versions", ["package", "version"], sorted(info["versions"].items())))
    rows = [[b["name"], "yes" if b["available"] else "no", b["version"] or "-", b["devices"] or b["reason"]]
            for b in info["backends"]]
    console.print(table("backends", ["backend", "available", "version", "devices / why not"], rows))
    if args.json:
        write_json(args.json, info)
    return 0


def _show_stage(component: str, name: str):
    """A spinner while one compile stage of one component runs."""
    from .console import stage

    return stage(f"{component}: {name}")


def _range(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX or MIN:OPT:MAX, got {text!r}") from None
    if len(values) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected MIN:MAX or MIN:OPT:MAX, got {text!r}")
    return values


def _profile_from_args(args: argparse.Namespace):
    """A ShapeProfile from --batch/--height/--width, the model's defaults for the rest."""
    if not (args.batch or args.height or args.width):
        return None
    from .components import default_profile, profile_with_ranges
    from .loading import load_pipeline

    return profile_with_ranges(default_profile(load_pipeline(args.model)), args.batch, args.height, args.width)


def _profile_for_generate(args: argparse.Namespace, image, pipe):
    """The model's default profile, widened to serve the requested size and image count, so
    `generate` compiles what it needs (a size that is not a multiple of 8 is left for the
    pipeline's own check to explain)."""
    from .components import ImageShape, ShapeProfile, default_profile

    base = default_profile(pipe)
    height = args.height or (image.size[1] if image else base.opt.height)
    width = args.width or (image.size[0] if image else base.opt.width)
    if height % base.multiple or width % base.multiple:
        return base
    wanted = ImageShape(args.num_images, height, width)
    low = ImageShape(*(min(getattr(base.min, d), getattr(wanted, d)) for d in ("batch", "height", "width")))
    high = ImageShape(*(max(getattr(base.max, d), getattr(wanted, d)) for d in ("batch", "height", "width")))
    return ShapeProfile(low, base.opt, high, base.multiple)


def _engine_options(args: argparse.Namespace):
    from .backends import EngineOptions

    return EngineOptions(threads=args.threads, builder_optimization_level=args.trt_opt_level)


@command("verify")
def cmd_verify(args: argparse.Namespace) -> int:
    """Compare every engine with torch at three shapes and an image with diffusers; exit 1 on failure."""
    from rich.markdown import Markdown

    from .console import console, stage, write_json
    from .verify import markdown, verify


    with stage("verifying"):
        report = verify(args.model, args.backend, precision=args.precision, cache_dir=args.cache_dir,
                        profile=_profile_from_args(args), onnx_dir=args.onnx, options=_engine_options(args),
                        image=not args.no_image, on_stage=_show_stage)
    console.print(Markdown(markdown(report)))
    for line in (c.line() for c in report.components if not c.passed):
        console.print(line, markup=False)
    if args.json:
        write_json(args.json, report)
    if not report.passed:
        console.print(f"verify FAILED for {', '.join(report.failed_components) or 'the image'}: rebuild with "
                      "`kasoku cache clear MODEL` and `kasoku compile MODEL`, or report the lines above.",
                      markup=False)
    return 0 if report.passed else 1


@command("bench")
def cmd_bench(args: argparse.Namespace) -> int:
    """Time each component and the whole pipeline per backend against torch eager (BENCHMARK.md)."""
    from rich.markdown import Markdown

    from .bench import bench, markdown, plot
    from .console import console, stage, write_json

    with stage("benchmarking"):
        report = bench(args.model, [b.strip() for b in args.backends.split(",") if b.strip()], steps=args.steps,
                       repeats=args.repeats, profile=_profile_from_args(args), components=args.components,
                       cache_dir=args.cache_dir, threads=args.threads, end_to_end=not args.components_only,
                       log=lambda message: console.log(message))
    console.print(Markdown(markdown(report)))
    if args.json:
        write_json(args.json, report)
    if args.plot:
        console.print(f"chart: {plot(report, args.plot)}")
    return 0


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    """The whole job on the built-in tiny pipeline, offline: compile, verify, time, generate."""
    from .console import console, write_json
    from .demo import print_demo_report, run_demo


    report = run_demo(workdir=args.workdir, output=args.output, cache_dir=args.cache_dir, on_stage=_show_stage)
    print_demo_report(report, console)
    if args.json:
        write_json(args.json, report)
    return 0 if report.passed else 1


@command("generate")
def cmd_generate(args: argparse.Namespace) -> int:
    """Generate images (txt2img, img2img with --image, inpaint with --image and --mask)."""
    import torch

    from .console import console, steps_bar, table
    from .loading import load_pipeline
    from .pipeline import compile

    output = Path(args.output)
    if not output.parent.exists():
        raise KasokuError(f"cannot write {output}: the folder {output.parent} does not exist.")
    image = _open_image(args.image, "--image") if args.image else None
    mask = _open_image(args.mask, "--mask").convert("L") if args.mask else None
    if mask is not None and image is None:
        raise KasokuError("--mask needs --image (the picture to inpaint).")

    start = time.perf_counter()
    reference = load_pipeline(args.model)  # loaded once: the profile and the engines both need it
    pipe = compile(reference, args.backend, precision=args.precision, cache_dir=args.cache_dir,
                   profile=_profile_for_generate(args, image, reference), options=_engine_options(args),
                   on_stage=_show_stage, label=str(args.model))
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
    console.print("backends: " + ", ".join(f"{n}={e.backend}" for n, e in pipe.engines.items()))
    for note in pipe.compile_report.notes:
        console.print(f"note: {note}", markup=False)
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


@command("batch")
def cmd_batch(args: argparse.Namespace) -> int:
    """Generate one image per line of a JSONL file, in this process or on a Ray cluster (--ray).

    Each line is one job: {"prompt": "...", "negative_prompt": "...", "seed": 1, "steps": 30, "guidance": 7.5,
    "height": 512, "width": 512, "id": "cat-1"}; only prompt is required (seed and id default to the line
    number, the size to the model's). DIR gets <id>.png per job and results.jsonl (one line per job). Every
    line and size is checked before any work starts; running the same command again after an interruption
    does only the jobs that are not done.
    """
    from .batch import import_ray, prepare, read_jobs, run_local, run_ray
    from .console import console, table, write_json

    if args.ray is None and (args.workers not in (None, 1) or args.gpus_per_worker):
        raise KasokuError("--workers and --gpus-per-worker need --ray (without it, the jobs run in this process).")
    if args.ray is not None:
        import_ray()  # a missing extra is the first thing to say
    jobs = read_jobs(args.prompts)
    threads = args.threads or (1 if args.ray is not None else None)  # Ray: one CPU per worker unless asked
    plan = prepare(args.model, jobs, args.out, batch_size=args.batch_size, backend=args.backend,
                   precision=args.precision, cache_dir=args.cache_dir, threads=threads, height=args.height,
                   width=args.width)
    bar = _batch_bar()
    task = bar.add_task("generating", total=None, start=False)

    def on_start(todo: int, skipped: int) -> None:
        if skipped:
            console.print(f"{skipped} of {len(plan.jobs)} jobs already done in {plan.out_dir}; doing the other {todo}")
        bar.update(task, total=todo)
        bar.start()
        bar.start_task(task)

    hooks = dict(on_start=on_start, on_result=lambda _result: bar.advance(task), on_stage=_show_stage)
    try:
        if args.ray is None:
            result = run_local(plan, **hooks)
        else:
            result = run_ray(plan, address=args.ray, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                             **hooks)
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


def _worker_startup(worker) -> str:
    ready = f"ready in {worker.startup_seconds:.1f} s: " if worker.startup_seconds is not None else ""
    return (f"{ready}imports {worker.import_seconds:.1f} s, model {worker.model_seconds:.1f} s, "
            f"engines {'built and loaded' if worker.built_stages else 'from the cache'} {worker.engine_seconds:.1f} s")


def _batch_bar():
    """Jobs done of the total, images per second since the start, and the time left."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    from .console import console

    class ImagesPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            elapsed = task.elapsed or 0.0
            rate = task.completed / elapsed if elapsed > 0 and task.completed else None
            return Text(f"{rate:.2f} img/s" if rate else "- img/s")

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("jobs"),
                    ImagesPerSecond(), TextColumn("ETA"), TimeRemainingColumn(), console=console)


def _open_image(path: Path, flag: str):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path).convert("RGB")
    except FileNotFoundError:
        raise KasokuError(f"{flag} {path} does not exist.") from None
    except UnidentifiedImageError:
        raise KasokuError(f"{flag} {path} is not an image PIL can read.") from None


# ---- parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from .components import COMPONENT_NAMES
    from .export import DEFAULT_EXPORTER, DEFAULT_OPSET, EXPORTERS
    from .schedulers import SCHEDULERS
    from .tiny import FAMILY_NAMES, PREDICTION_TYPES

    parser = argparse.ArgumentParser(
        prog="kasoku",
        description=(
            "kasoku (加速) compiles diffusers Stable Diffusion 1.x, 2.x and XL pipelines into ONNX Runtime, OpenVINO "
            "and TensorRT engines and proves they compute the same thing. Start with `kasoku demo`."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        doc = COMMANDS[name].__doc__.strip()
        return sub.add_parser(name, help=doc.splitlines()[0], description=doc, **kwargs)

    p = add("demo")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the tiny model here (default: a temporary folder)")
    p.add_argument("-o", "--output", type=Path, default=Path("kasoku-demo.png"), help="default kasoku-demo.png")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $KASOKU_CACHE or ~/.cache/kasoku")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")

    p = add("generate")
    p.add_argument("model", help="a diffusers pipeline folder (or a hub id when online)")
    p.add_argument("prompt", help="what to draw")
    p.add_argument("-o", "--output", type=Path, default=Path("out.png"),
                   help="image file (default out.png; out-0.png, out-1.png, ... for several)")
    p.add_argument("--negative", default=None, help="negative prompt")
    p.add_argument("--prompt-2", default=None, help="SDXL: the prompt for the second text encoder (default: PROMPT)")
    p.add_argument("--negative-2", default=None, help="SDXL: the negative prompt for the second text encoder")
    p.add_argument("--steps", type=int, default=30, help="denoising steps (default 30)")
    p.add_argument("--guidance", type=float, default=7.5, help="classifier-free guidance scale (default 7.5)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    p.add_argument("--num-images", type=int, default=1, help="images per prompt (default 1)")
    p.add_argument("--height", type=int, default=None, help="image height in pixels (default: the model's native)")
    p.add_argument("--width", type=int, default=None, help="image width in pixels (default: the model's native)")
    p.add_argument("--image", type=Path, help="img2img / inpaint: the input image")
    p.add_argument("--strength", type=float, default=0.8, help="img2img / inpaint strength (default 0.8)")
    p.add_argument("--mask", type=Path, help="inpaint: white where to paint")
    p.add_argument("--scheduler", choices=list(SCHEDULERS), default=None,
                   help="swap the model's scheduler (default: keep it)")
    _add_engine_arguments(p, profile_flags=False)

    from .backends import BACKEND_CHOICES
    from .components import Precision

    p = add("batch")
    p.add_argument("model", help="a diffusers pipeline folder (or a hub id when online)")
    p.add_argument("prompts", type=Path, metavar="PROMPTS.jsonl",
                   help="one job per line: prompt, negative_prompt, seed, steps, guidance, height, width, id")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="folder for <id>.png per job and results.jsonl (created if missing; jobs already "
                        "there are skipped)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray workers (needs kasoku[ray]): alone, a Ray instance started on this machine; "
                        "with ADDRESS (auto, ray://HEAD:10001, HEAD:6379) that cluster, whose nodes must have "
                        "kasoku and see DIR, the model and --cache-dir at the same paths")
    p.add_argument("--workers", type=int, default=None,
                   help="with --ray: workers, each holding one pipeline (default: as many as the cluster's CPUs, "
                        "or GPUs with --gpus-per-worker, hold)")
    p.add_argument("--batch-size", type=int, default=4,
                   help="images per engine call (default 4); jobs batch together when they share size, steps, "
                        "guidance and whether they have a negative prompt")
    p.add_argument("--gpus-per-worker", type=float, default=0.0,
                   help="with --ray: GPUs Ray gives each worker, e.g. 1 for GPU backends (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per engine, and the CPUs Ray reserves per worker (default: the runtime's; "
                        "1 with --ray)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="auto (default): TensorRT then ONNX Runtime CUDA on a GPU; on a CPU the faster of "
                        "onnxruntime and openvino per component, measured once")
    p.add_argument("--precision", choices=[p.value for p in Precision], default="fp32", help="default fp32")
    p.add_argument("--height", type=_range, metavar="MIN:MAX",
                   help="image heights the engines serve (default: half to double the model's size)")
    p.add_argument("--width", type=_range, metavar="MIN:MAX",
                   help="image widths the engines serve (default: half to double the model's size)")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $KASOKU_CACHE or ~/.cache/kasoku")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the run's summary as JSON")

    p = add("tiny")
    p.add_argument("dir", type=Path, help="an empty or new folder to write the pipeline into")
    p.add_argument("--family", choices=FAMILY_NAMES, default="sd1",
                   help="sd1 (default): SD 1.x; sd2: SD 2.x (OpenCLIP-style text encoder, per-block heads, linear "
                        "projections); sdxl: SDXL (two text encoders, added size/crop conditioning)")
    p.add_argument("--prediction", choices=PREDICTION_TYPES, default="epsilon",
                   help="the scheduler's prediction type: epsilon (default; SD 2 base at 512) or v_prediction "
                        "(SD 2 at 768)")
    p.add_argument("--inpainting", action="store_true", help="the 9-input-channel inpainting U-Net variant")
    p.add_argument("--seed", type=int, default=0, help="seed of the deterministic weights (default 0)")

    p = add("export")
    p.add_argument("model", help="a diffusers pipeline folder (or a hub id when online)")
    p.add_argument("outdir", type=Path, help="folder for <component>/model.onnx and manifest.json")
    p.add_argument("--exporter", choices=EXPORTERS, default=DEFAULT_EXPORTER,
                   help=f"torch.onnx exporter (default {DEFAULT_EXPORTER})")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--components", nargs="+", choices=COMPONENT_NAMES, default=None,
                   metavar="NAME", help=f"which of {' '.join(COMPONENT_NAMES)} (default: all the model has)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the manifest to PATH")

    p = add("compile")
    p.add_argument("model", help="a diffusers pipeline folder (or a hub id when online)")
    _add_engine_arguments(p)
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")

    p = add("cache")
    p.add_argument("action", choices=("ls", "clear"), help="ls: list the entries; clear: remove them")
    p.add_argument("model", nargs="?", help="with clear: only the entries of this model (folder or name)")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $KASOKU_CACHE or ~/.cache/kasoku")
    p.add_argument("--json", type=Path, metavar="PATH", help="with ls: also write the list as JSON")

    p = add("verify")
    p.add_argument("model", help="a diffusers pipeline folder (or a hub id when online)")
    _add_engine_arguments(p)
    p.add_argument("--onnx", type=Path, default=None, metavar="DIR",
                   help="build the engines from these ONNX files (a `kasoku export` folder) instead of exporting")
    p.add_argument("--no-image", action="store_true", help="components only, skip the image comparison")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")

    p = add("bench")
    p.add_argument("model", help="a diffusers pipeline folder (or a hub id when online)")
    p.add_argument("--backends", default="onnxruntime,openvino",
                   help="comma-separated kasoku backends and peers (torch.compile, onnxruntime-defaults, "
                        "openvino-defaults); torch eager is always timed. Default: onnxruntime,openvino")
    p.add_argument("--steps", type=int, default=4, help="denoising steps of the end-to-end image (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after warm-up, at least 3 (default 3)")
    p.add_argument("--components-only", action="store_true", help="skip the end-to-end image")
    p.add_argument("--plot", type=Path, metavar="PATH", help="also draw a PNG bar chart")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    _add_engine_arguments(p)

    p = add("info")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    return parser


def _add_engine_arguments(p: argparse.ArgumentParser, profile_flags: bool = True) -> None:
    """The options that say which engines to build (compile, generate, verify, bench)."""
    from .backends import BACKEND_CHOICES
    from .components import COMPONENT_NAMES, Precision
    from .export import DEFAULT_EXPORTER, DEFAULT_OPSET, EXPORTERS

    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="auto (default): TensorRT then ONNX Runtime CUDA on a GPU; on a CPU the faster of "
                        "onnxruntime and openvino per component, measured once")
    p.add_argument("--precision", choices=[p.value for p in Precision], default="fp32", help="default fp32")
    if profile_flags:
        p.add_argument("--batch", type=_range, metavar="MIN:MAX", help="images per call the engines serve")
        p.add_argument("--height", type=_range, metavar="MIN:MAX", help="image heights in pixels")
        p.add_argument("--width", type=_range, metavar="MIN:MAX", help="image widths in pixels")
    p.add_argument("--components", nargs="+", choices=COMPONENT_NAMES, default=None,
                   metavar="NAME", help=f"which of {' '.join(COMPONENT_NAMES)} (default: all the model has)")
    p.add_argument("--exporter", choices=EXPORTERS, default=DEFAULT_EXPORTER, help=argparse.SUPPRESS)
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=None, help="CPU threads per engine (default: the runtime's)")
    p.add_argument("--trt-opt-level", type=int, default=3, help="TensorRT builder optimization level 0-5 (default 3)")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $KASOKU_CACHE or ~/.cache/kasoku")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from rich.markup import escape

    from .console import console, quiet_third_party_logs

    quiet_third_party_logs()
    try:
        return COMMANDS[args.command](args)
    except KasokuError as error:
        console.print("[bold red]error:[/]", escape(str(error)), soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
