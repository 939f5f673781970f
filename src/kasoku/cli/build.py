"""`kasoku tiny`, `kasoku export`, `kasoku compile`: models in, ONNX files and engines out."""

from __future__ import annotations

import argparse
from pathlib import Path

from .base import (
    Command,
    add_controlnet,
    add_engine_arguments,
    add_json,
    add_model,
    add_recipe,
    add_step_cache_arguments,
    add_tiny_vae,
    component_name,
    controlnets_from_args,
    non_negative_int,
    options_from_args,
    positive_int,
    profile_from_args,
    show_stage,
    tiny_vae_from_args,
)


class Tiny(Command):
    """Write a built-in tiny pipeline (SD 1.x to 3.5, Flux.1, PixArt-Σ, Sana, Flux.2 klein, ...) as a folder."""

    name = "tiny"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ..core.choices import FAMILY_TITLES, PREDICTION_TYPES
        from ..core.choices import RECORDED_TINY_FAMILIES as TINY_FAMILIES

        p.add_argument("dir", type=Path, help="an empty or new folder to write the pipeline into")
        p.add_argument("--family", choices=[*FAMILY_TITLES, *TINY_FAMILIES], default="sd1", metavar="FAMILY",
                       help="; ".join(f"{name}: {title}" for name, title in FAMILY_TITLES.items())
                       + f" (default sd1); or a family kasoku compiles from its recorded calls: "
                       f"{', '.join(TINY_FAMILIES)}")
        p.add_argument("--prediction", choices=PREDICTION_TYPES, default="epsilon",
                       help="the scheduler's prediction type: epsilon (default; SD 2 base at 512) or v_prediction "
                            "(SD 2 at 768)")
        p.add_argument("--inpainting", action="store_true",
                       help="the 9-input-channel inpainting U-Net variant (U-Net families)")
        p.add_argument("--controlnet", action="store_true",
                       help="also write a tiny ControlNet for it in DIR/controlnet (use it with --controlnet "
                            "DIR/controlnet)")
        p.add_argument("--lcm", action="store_true",
                       help="an LCM-distilled U-Net (a guidance embedding) with diffusers' LCMScheduler, in the "
                            "family's LCM pipeline (U-Net families; LatentConsistencyModelPipeline for sd1/sd2)")
        p.add_argument("--tiny-vae", action="store_true",
                       help="also write a tiny AutoencoderTiny (TAESD's layout) for it in DIR/tiny_vae (use it with "
                            "--tiny-vae DIR/tiny_vae)")
        p.add_argument("--ip-adapter", action="store_true",
                       help="also write a plain and a Plus IP-Adapter for it, with their image encoder, in "
                            "DIR/ip_adapter (use them with --ip-adapter DIR/ip_adapter/ip-adapter.safetensors; U-Net "
                            "families)")
        p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the deterministic weights (default 0)")

    def run(self, args: argparse.Namespace) -> int:
        from ..core.console import console
        from ..families import FAMILIES, UNetFamily
        from ..tools.tiny import (
            CONTROLNET_FOLDER,
            IP_ADAPTER_FOLDER,
            TINY_VAE_FOLDER,
            check_tiny_folder,
            check_variant,
            write_tiny_pipeline,
        )

        check_tiny_folder(args.dir)
        check_variant(args.family, inpainting=args.inpainting, prediction=args.prediction, controlnet=args.controlnet,
                      lcm=args.lcm, ip_adapter=args.ip_adapter)
        path = write_tiny_pipeline(args.dir, family=args.family, inpainting=args.inpainting,
                                   prediction=args.prediction, seed=args.seed, controlnet=args.controlnet,
                                   tiny_vae=args.tiny_vae, lcm=args.lcm, ip_adapter=args.ip_adapter)
        kind = "inpainting " if args.inpainting else "LCM " if args.lcm else ""
        family = FAMILIES.get(args.family)
        prediction = f"{args.prediction}, " if isinstance(family, UNetFamily) else ""
        console.print(f"wrote the tiny {family.title if family else args.family} {kind}pipeline "
                      f"({prediction}seed {args.seed}) to {path}")
        if args.controlnet:
            console.print(f"wrote its tiny ControlNet to {path / CONTROLNET_FOLDER}")
        if args.tiny_vae:
            console.print(f"wrote its tiny autoencoder (AutoencoderTiny) to {path / TINY_VAE_FOLDER}")
        if args.ip_adapter:
            console.print(f"wrote its tiny IP-Adapters (plain, Plus) and their image encoder to "
                          f"{path / IP_ADAPTER_FOLDER}")
        return 0


class Export(Command):
    """Export a pipeline's components to ONNX, with a parity check against torch."""

    name = "export"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ..core.choices import COMPONENT_NAMES
        from ..core.options import DEFAULT_EXPORTER, DEFAULT_OPSET, EXPORTERS

        add_model(p)
        add_controlnet(p)
        p.add_argument("outdir", type=Path, help="folder for <component>/model.onnx and manifest.json")
        p.add_argument("--exporter", choices=EXPORTERS, default=DEFAULT_EXPORTER,
                       help=f"torch.onnx exporter (default {DEFAULT_EXPORTER})")
        p.add_argument("--opset", type=positive_int, default=DEFAULT_OPSET,
                       help=f"ONNX opset (default {DEFAULT_OPSET})")
        p.add_argument("--components", nargs="+", type=component_name, default=None,
                       metavar="NAME", help=f"which of {' '.join(COMPONENT_NAMES)} (default: all the model has)")
        add_json(p, "the manifest")

    def run(self, args: argparse.Namespace) -> int:
        from ..build.export import export_pipeline
        from ..core.console import console, stage, table, write_json
        from ..core.errors import KasokuError

        if args.outdir.exists() and not args.outdir.is_dir():
            raise KasokuError(f"{args.outdir} is a file; give a folder for the ONNX files.")
        with stage(f"exporting {args.model} ({args.exporter}, opset {args.opset})"):
            manifest = export_pipeline(args.model, args.outdir, components=args.components, exporter=args.exporter,
                                       opset=args.opset, controlnet=controlnets_from_args(args))
        rows = []
        for c in manifest.components:
            worst = max(c.parity, key=lambda p: p.max_abs / p.limit)
            rows.append(
                [c.name, c.path, f"{c.size_bytes / 1e6:.1f} MB", f"{c.seconds:.1f} s",
                 f"{worst.max_abs:.1e} (tol {worst.limit:.0e})", len({p.shape for p in c.parity})]
            )
        console.print(table("ONNX export", ["component", "file", "size", "time", "worst max|Δ| vs torch",
                                            "shapes checked"], rows))
        console.print(f"manifest: {Path(args.outdir) / 'manifest.json'}")
        if args.json:
            write_json(args.json, manifest)
        return 0


class Compile(Command):
    """Build the engines of every component into the cache (export, optimize, engine).

    A component whose build would not fit in this machine's free memory is refused before a weight is read; int8
    calibration, whose memory cannot be counted beforehand, is stopped with the same kind of error when the free
    memory runs out. KASOKU_MEMORY_CHECK=0 turns both off (a machine with swap, say)."""

    name = "compile"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_model(p)
        add_controlnet(p)
        add_tiny_vae(p)
        add_engine_arguments(p)
        add_recipe(p)
        add_step_cache_arguments(p, per_call=False)
        add_json(p)

    def run(self, args: argparse.Namespace) -> int:
        from ..core.cache import default_cache_dir
        from ..core.console import console, table, write_json
        from ..model.pipeline_model import Model
        from ..pipeline.compiling import compile_components

        model = Model.load(args.model, lazy=True, controlnet=controlnets_from_args(args),
                           tiny_vae=tiny_vae_from_args(args), label=str(args.model))
        options = options_from_args(args, profile_from_args(args, model))
        chosen = None
        if options.recipe:
            from ..policies.recipes import with_recipe

            model, options, chosen = with_recipe(model, options, options.cache_dir or default_cache_dir())
        _, report = compile_components(model, options, on_stage=show_stage, label=str(args.model))
        if chosen is not None:
            report.notes.insert(0, chosen.note)
        rows = [[s.component, s.stage, s.status, f"{s.seconds:.1f} s", s.key[:12]] for s in report.stages]
        console.print(table(f"compile {report.model} ({model.family.title}, {report.precision})",
                            ["component", "stage", "cache", "time", "entry"], rows))
        for note in report.notes:
            console.print(f"note: {note}", markup=False)
        console.print("backends: " + ", ".join(f"{c}={b}" for c, b in report.backends.items()))
        console.print(f"{report.built} built, {len(report.stages) - report.built} reused from the cache, "
                      f"{report.seconds:.1f} s in all")
        if args.json:
            write_json(args.json, report)
        return 0
