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
        from rich.markdown import Markdown

        from ..console import console, stage, write_json
        from ..verification import markdown, verify

        options = options_from_args(args, profile_from_args(args)).replace(onnx_dir=args.onnx)
        with stage("verifying"):
            report = verify(args.model, controlnet=controlnets_from_args(args), tiny_vae=tiny_vae_from_args(args),
                            options=options,
                            image=not args.no_image, on_stage=show_stage, ip_adapter=ip_adapter_files(args),
                            **step_caching_from_args(args))
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
        from rich.markdown import Markdown

        from ..benchmark import bench, check_contenders, markdown, plot
        from ..console import console, stage, write_json
        from ..errors import KasokuError

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
                           log=lambda message: console.log(message), ip_adapter=ip_adapter_files(args))
        console.print(Markdown(markdown(report)))
        if args.json:
            write_json(args.json, report)
        if args.plot:
            console.print(f"chart: {plot(report, args.plot)}")
        return 0


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
        from ..console import console, write_json
        from ..demo import print_demo_report, run_demo

        check_output_file(args.output)
        report = run_demo(workdir=args.workdir, output=args.output, cache_dir=args.cache_dir, on_stage=show_stage)
        print_demo_report(report, console)
        if args.json:
            write_json(args.json, report)
        return 0 if report.passed else 1
