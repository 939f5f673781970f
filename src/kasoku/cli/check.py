"""`kasoku verify`, `kasoku bench` and `kasoku demo`: prove the engines, time them, show it all."""

from __future__ import annotations

import argparse
from pathlib import Path

from .base import (
    Command,
    add_cache_dir,
    add_controlnet,
    add_engine_arguments,
    add_ip_adapter_files,
    add_json,
    add_model,
    add_step_cache_arguments,
    add_tiny_vae,
    check_output_file,
    controlnets_from_args,
    finite_float,
    image_size,
    ip_adapter_files,
    options_from_args,
    positive_int,
    profile_from_args,
    repeats,
    show_stage,
    step_caching_from_args,
    tiny_vae_from_args,
)


class Verify(Command):
    """Compare every engine with torch at three shapes and an image with diffusers; exit 1 on failure.

    With --cache-interval N, the step-cache engines are checked too, and images with step caching are held
    to the same engines' images without it (PSNR and SSIM on three prompts, the same initial latents)."""

    name = "verify"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_model(p)
        add_controlnet(p)
        add_tiny_vae(p)
        add_ip_adapter_files(p)
        add_engine_arguments(p)
        add_step_cache_arguments(p, per_call=True)
        p.add_argument("--onnx", type=Path, default=None, metavar="DIR",
                       help="build the engines from these ONNX files (a `kasoku export` folder) instead of exporting")
        p.add_argument("--no-image", action="store_true", help="components only, skip the image comparison")
        add_json(p)

    def run(self, args: argparse.Namespace) -> int:
        from ..core.console import console, show_markdown, stage, write_json
        from ..tools.verification import markdown, verify

        options = options_from_args(args, profile_from_args(args)).replace(onnx_dir=args.onnx)
        with stage("verifying"):
            report = verify(args.model, controlnet=controlnets_from_args(args), tiny_vae=tiny_vae_from_args(args),
                            options=options,
                            image=not args.no_image, on_stage=show_stage, ip_adapter=ip_adapter_files(args),
                            **step_caching_from_args(args))
        show_markdown(markdown(report))
        for line in (c.line() for c in report.components if not c.passed):
            console.print(line, markup=False)
        if args.json:
            write_json(args.json, report)
        if not report.passed:
            console.print(f"verify FAILED for {', '.join(report.failed_components) or 'the image'}: rebuild with "
                          "`kasoku cache clear MODEL` and `kasoku compile MODEL`, or report the lines above.",
                          markup=False)
        return 0 if report.passed else 1


class Bench(Command):
    """Time each component and the whole pipeline per backend against torch eager (docs/BENCHMARKS.md)."""

    name = "bench"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_model(p)
        add_controlnet(p)
        add_ip_adapter_files(p)
        p.add_argument("--backends", default="onnxruntime,openvino",
                       help="comma-separated kasoku backends and peers (torch.compile, onnxruntime-defaults, "
                            "openvino-defaults); torch eager is always timed. Default: onnxruntime,openvino")
        p.add_argument("--steps", type=positive_int, default=4,
                       help="denoising steps of the end-to-end image (default 4)")
        p.add_argument("--repeats", type=repeats, default=3,
                       help="timed repeats after warm-up, at least 3 (default 3)")
        p.add_argument("--components-only", action="store_true", help="skip the end-to-end image")
        p.add_argument("--plot", type=Path, metavar="PATH", help="also draw a PNG bar chart")
        add_json(p)
        add_engine_arguments(p)

    def run(self, args: argparse.Namespace) -> int:
        from ..core.console import console, progress_line, show_markdown, stage, write_json
        from ..core.errors import KasokuError
        from ..tools.benchmark import bench, check_contenders, markdown, plot

        if args.repeats < 3:
            raise KasokuError(f"--repeats must be at least 3 (a median of repeats) but is {args.repeats}.")
        contenders = check_contenders([b.strip() for b in args.backends.split(",") if b.strip()])
        if args.plot:
            check_output_file(args.plot, "--plot")
        controlnet = controlnets_from_args(args)
        with stage("benchmarking"):
            report = bench(args.model, contenders, controlnet=controlnet, steps=args.steps, repeats=args.repeats,
                           profile=profile_from_args(args), components=args.components, cache_dir=args.cache_dir,
                           threads=args.threads, end_to_end=not args.components_only,
                           log=progress_line, ip_adapter=ip_adapter_files(args))
        show_markdown(markdown(report))
        if args.json:
            write_json(args.json, report)
        if args.plot:
            console.print(f"chart: {plot(report, args.plot)}")
        return 0


class Tune(Command):
    """Find the fastest recipe on this machine within a fidelity bound: each precision x step-caching setting x VAE
    (the tiny one with --tiny-vae), timed on a fixed prompt set and held to the fp32 engines' images (PSNR/SSIM).

    The trials and their Pareto front are recorded in the cache per model, machine, backend and size, after every
    trial: an interrupted or budget-limited run resumes when run again. `--recipe fastest` on compile, generate,
    batch and serve (or kasoku.compile(pipe, recipe="fastest", min_psnr=DB)) then runs the winner."""

    name = "tune"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ..core.choices import TUNE_PRECISIONS as PRECISIONS

        add_model(p)
        p.add_argument("--min-psnr", type=finite_float, default=None, metavar="DB",
                       help="name the winner: the fastest recipe whose images stay at least DB dB from the fp32 "
                            "engines' (default 35; the record keeps the whole front, any bound can be asked later)")
        p.add_argument("--steps", type=positive_int, default=None,
                       help="denoising steps of the measured images (default: the family's, or the scheduler's "
                            "for a few-step model); step caching saves more the more steps there are")
        p.add_argument("--size", type=image_size, default=None, metavar="WxH",
                       help="the image size to tune for (default: the model's native); the recipe's engines are "
                            "built for it")
        p.add_argument("--guidance", type=finite_float, default=None,
                       help="guidance scale of the measured images (default: the family's)")
        p.add_argument("--budget-s", type=float, default=None, metavar="S",
                       help="stop starting trials after S seconds (the fp32 reference always runs); run again to "
                            "measure the rest")
        p.add_argument("--precisions", default=",".join(PRECISIONS),
                       help=f"comma-separated precisions to try (default {','.join(PRECISIONS)}; those this machine "
                            "cannot build are listed as such)")
        add_tiny_vae_candidate(p)
        p.add_argument("--range-engines", action="store_true",
                       help="also try engines for the model's range of sizes (default: exact-shape engines only, "
                            "faster on CPUs)")
        p.add_argument("--restart", action="store_true", help="forget an earlier record of this tuning")
        p.add_argument("--chart", type=Path, default=None, metavar="PNG",
                       help="where to draw the chart of the front (default: beside the record in the cache)")
        p.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads per engine (default: the runtime's); part of the record's key")
        add_backend_only(p)
        add_cache_dir(p)
        add_json(p)

    def run(self, args: argparse.Namespace) -> int:
        from ..core.console import console, show_markdown, steps_bar, write_json
        from ..core.errors import KasokuError
        from ..core.options import DEFAULT_MIN_PSNR
        from ..tools.tune import markdown, plot, tune

        if args.budget_s is not None and args.budget_s <= 0:
            raise KasokuError(f"--budget-s must be a positive number of seconds but is {args.budget_s:g}.")
        if args.chart:
            check_output_file(args.chart, "--chart", suffixes=(".png",))
        min_psnr = DEFAULT_MIN_PSNR if args.min_psnr is None else args.min_psnr
        with steps_bar() as bar:
            task = bar.add_task("tuning", total=None)

            def on_trial(trial, done: int, total: int) -> None:
                what = (f"{trial.seconds:.3f} s, " + ("reference" if trial.recipe.is_reference else
                                                      f"{trial.psnr_db:.1f} dB")) if trial.ok else trial.error
                console.print(f"{trial.recipe.label}: {what}", markup=False)
                bar.update(task, completed=done, total=total)

            report = tune(args.model, backend=args.backend, steps=args.steps,
                          size=(args.size.width, args.size.height) if args.size else None, guidance=args.guidance,
                          min_psnr=min_psnr, budget_s=args.budget_s, tiny_vae=tiny_vae_from_args(args),
                          precisions=[p for p in args.precisions.split(",") if p.strip()],
                          range_engines=args.range_engines, cache_dir=args.cache_dir, threads=args.threads,
                          restart=args.restart, on_trial=on_trial, on_stage=show_stage)
        show_markdown(markdown(report))
        if report.resumed:
            console.print(f"resumed: {report.resumed} trial(s) were measured by an earlier run", markup=False)
        console.print(f"record: {report.path}", markup=False)
        try:
            console.print(f"chart: {plot(report, args.chart or report.path.with_suffix('.png'))}", markup=False)
        except KasokuError as error:
            console.print(f"note: no chart: {error}", markup=False)
        if args.json:
            write_json(args.json, report)
        return 0


def add_tiny_vae_candidate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny-vae", type=Path, default=None, metavar="PATH",
                        help="an AutoencoderTiny folder (TAESD): every recipe is also tried with it in place of the "
                             "model's VAE (judged against the full VAE's fp32 images)")


def add_backend_only(parser: argparse.ArgumentParser) -> None:
    from ..core.choices import BACKEND_CHOICES

    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                        help="the backend every recipe runs on (default auto: the faster per component, measured "
                             "once per model and machine); part of the record's key")


class Demo(Command):
    """The whole job on the built-in tiny pipeline, offline: compile, verify, time, generate."""

    name = "demo"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--workdir", type=Path, default=None,
                       help="keep the tiny model here (default: a temporary folder)")
        p.add_argument("-o", "--output", type=Path, default=Path("kasoku-demo.png"), help="default kasoku-demo.png")
        add_cache_dir(p)
        add_json(p)

    def run(self, args: argparse.Namespace) -> int:
        from ..core.console import console, write_json
        from ..tools.demo import print_demo_report, run_demo

        check_output_file(args.output)
        report = run_demo(workdir=args.workdir, output=args.output, cache_dir=args.cache_dir, on_stage=show_stage)
        print_demo_report(report, console)
        if args.json:
            write_json(args.json, report)
        return 0 if report.passed else 1
