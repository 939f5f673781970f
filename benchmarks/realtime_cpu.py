"""Real-time images on a CPU (issue 25): few-step models with the full VAE and the tiny one (TAESD).

Workloads, each a full-size architecture with random weights (nothing can be downloaded here), 512x512, one
image, the same initial latents for every contender:

- ``turbo``: SD 2.1-base (what SD-Turbo is: OpenCLIP-H text encoder, SD 2's U-Net), Euler with "trailing"
  spacing, 1 step, guidance 0 (SD-Turbo's documented setting: no classifier-free guidance);
- ``lcm``: SD 1.5 with diffusers' LCMScheduler, 4 steps, guidance 1 (LCM-LoRA's setting: no guidance).

Each with ``full`` (AutoencoderKL) and ``taesd`` (AutoencoderTiny in TAESD's layout, random weights) decoding.

Contenders, each in its own process (the peers in their own virtual environments, created when missing, see
docs/BENCHMARKS.md): ``diffusers`` (torch eager fp32, the reference), ``kasoku-fp32``, ``kasoku-bf16``,
``kasoku-int8`` (OpenVINO, exact-shape 512x512 engines without guidance: what `kasoku generate` builds for this
call), ``optimum-intel-default-static`` (OVStableDiffusionPipeline, its defaults: bf16 on a CPU with AMX),
``openvino-genai`` (Text2ImagePipeline on optimum-intel's export; it takes a seed, not latents) and
``fastsd-recipe`` (FastSD CPU's: optimum-intel with a TAESD decoder in OpenVINO). The peers run the full VAE
only, fastsd-recipe TAESD only.

Reported: seconds per image (median of --repeats after a warm-up), the share of the VAE decoder and of the text
encoder (kasoku: its engines' own times; diffusers: the torch modules' times), the share that is no engine at
all (tokenizer, scheduler, copies), PSNR and SSIM against diffusers fp32 with the same VAE and latents, the
cold compile, and each process's peak memory.

    python benchmarks/realtime_cpu.py                    # everything (about an hour on 2 cores, peers included)
    python benchmarks/realtime_cpu.py --workloads turbo --contenders diffusers,kasoku-bf16 --repeats 3
    python benchmarks/realtime_cpu.py --smoke            # the tiny pipeline at 64x64: a check of this script
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmark's model builder, peer environments and machine line
from full_sd15 import build_sd15, machine_description, peak_mb, peer_python  # noqa: E402

WORK = HERE / ".models" / "realtime-work"
RESULTS = HERE / "results"
SMOKE_DIR = Path("/tmp/kasoku-realtime-smoke")
SIZE = 512
PROMPT = "a beautiful photograph of mt fuji during cherry blossom"
TXT2IMG = ("text_encoder", "unet", "vae_decoder")


@dataclass(frozen=True)
class Workload:
    family: str  # the SD architecture: sd2 (2.1-base) or sd1 (1.5)
    scheduler: str  # kasoku's scheduler name
    steps: int
    guidance: float


WORKLOADS = {"turbo": Workload("sd2", "euler-trailing", 1, 0.0), "lcm": Workload("sd1", "lcm", 4, 1.0)}
VAES = ("full", "taesd")
KASOKU = {"kasoku-fp32": "fp32", "kasoku-bf16": "bf16", "kasoku-int8": "int8"}
PEERS = {"optimum-intel-default-static": "full", "openvino-genai": "full", "fastsd-recipe": "taesd"}
CONTENDERS = ("diffusers", *KASOKU, *PEERS)
PEER_VENV = "optimum-intel"  # benchmarks/full_sd15.py's: optimum-intel[openvino], diffusers, openvino-genai


def use_smoke() -> None:
    global WORK, RESULTS, SIZE
    WORK, RESULTS, SIZE = SMOKE_DIR / "work", SMOKE_DIR / "results", 64


# ---- the models ---------------------------------------------------------------------------------------------


def model_dir(workload: str) -> Path:
    return WORK / f"model-{workload}"


def taesd_dir() -> Path:
    return WORK / "taesd"


def build_model(workload: str) -> Path:
    """The workload's architecture at full size with random weights and its scheduler, as a diffusers folder
    (the tiny pipeline of its family with --smoke)."""
    from kasoku.core.schedulers import scheduler_named
    from kasoku.tools.tiny import tiny_pipeline

    spec = WORKLOADS[workload]
    folder = model_dir(workload)
    if SIZE == 64:
        pipe = tiny_pipeline(family=spec.family)
    elif spec.family == "sd1":
        build_sd15(folder)
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(folder)
    else:
        pipe = _sd21_base()
    pipe.scheduler = scheduler_named(spec.scheduler, pipe.scheduler)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def _sd21_base():
    """stabilityai/stable-diffusion-2-1-base's architecture (SD-Turbo's): OpenCLIP ViT-H's text tower (23 layers as
    diffusers ships it), SD 2's U-Net (linear projections, per-block heads), SD's VAE; random weights."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from kasoku.architectures.tiny import tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer("!")  # a real CLIP BPE tokenizer (OpenCLIP pads with "!")
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16,
        max_position_embeddings=77, projection_dim=512, hidden_act="gelu", bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    unet = UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
        cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
                        block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1, num_train_timesteps=1000)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def build_taesd() -> Path:
    """TAESD's architecture (diffusers' AutoencoderTiny defaults) with random weights (the tiny one with --smoke)."""
    from diffusers import AutoencoderTiny

    from kasoku.families import FAMILIES

    torch.manual_seed(1)
    tiny = FAMILIES["sd1"].tiny_vae() if SIZE == 64 else AutoencoderTiny()
    tiny.save_pretrained(taesd_dir(), safe_serialization=True)
    return taesd_dir()


def latents_file() -> Path:
    path = WORK / "latents.npy"
    if not path.exists():
        np.save(path, torch.randn((1, 4, SIZE // 8, SIZE // 8), generator=torch.Generator().manual_seed(0)).numpy())
    return path


# ---- one stage: a contender's image -------------------------------------------------------------------------


class ModuleClock:
    """Seconds spent in torch modules' calls (diffusers eager's shares of text encoder, U-Net and VAE decoder)."""

    def __init__(self, pipe):
        self.seconds: dict[str, float] = {}
        for name, module, method in (("text_encoder", pipe.text_encoder, "forward"), ("unet", pipe.unet, "forward"),
                                     ("vae_decoder", pipe.vae, "decode")):
            setattr(module, method, self._timed(name, getattr(module, method)))

    def _timed(self, name, call):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return run

    def reset(self) -> None:
        self.seconds = {}


def stage_image(target: str, args) -> dict:
    """`target` is WORKLOAD:VAE:CONTENDER: a warm-up call, then --repeats timed calls from the shared latents."""
    workload_name, vae, contender = target.split(":")
    workload = WORKLOADS[workload_name]
    out = WORK / "images" / f"{workload_name}-{vae}-{contender}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if contender in PEERS:
        return _peer_image(contender, workload_name, vae, out, args)
    from kasoku.model.loading import load_pipeline

    latents = torch.from_numpy(np.load(latents_file()))
    tiny = taesd_dir() if vae == "taesd" else None
    result: dict = {}
    start = time.perf_counter()
    if contender == "diffusers":
        pipe = load_pipeline(model_dir(workload_name), tiny_vae=tiny)
        clock = ModuleClock(pipe)
        result["load_s"] = time.perf_counter() - start
    else:
        import kasoku
        from kasoku.core.components import ImageShape, ShapeProfile
        from kasoku.model.pipeline_model import Model

        multiple = Model.load(model_dir(workload_name), lazy=True).pixel_multiple
        profile = ShapeProfile.exact(ImageShape(1, SIZE, SIZE), guidance=False, multiple=multiple)
        pipe = kasoku.KasokuPipeline.from_pretrained(
            model_dir(workload_name), "openvino", precision=KASOKU[contender], profile=profile, components=TXT2IMG,
            tiny_vae=tiny, cache_dir=WORK / "cache", threads=args.threads)
        clock = None
        result.update(compile_s=time.perf_counter() - start, built=pipe.compile_report.built,
                      precisions=pipe.compile_report.precisions)

    def generate():  # a seeded generator too: LCM's steps draw fresh noise
        return pipe(PROMPT, num_inference_steps=workload.steps, guidance_scale=workload.guidance, height=SIZE,
                    width=SIZE, latents=latents, generator=torch.Generator().manual_seed(0),
                    output_type="np").images[0]

    start = time.perf_counter()
    generate()
    result["warmup_s"] = time.perf_counter() - start
    samples, shares = [], []
    for _ in range(args.repeats):
        if clock:
            clock.reset()
        else:
            pipe.times.reset()
        start = time.perf_counter()
        image = generate()
        seconds = time.perf_counter() - start
        samples.append(seconds)
        parts = dict(clock.seconds) if clock else dict(pipe.times.seconds)
        shares.append({name: parts.get(name, 0.0) / seconds for name in TXT2IMG})
    result["seconds"] = samples
    result["share"] = {name: statistics.median(s[name] for s in shares) for name in TXT2IMG}
    result["share"]["not_engines"] = max(0.0, 1.0 - sum(result["share"].values()))
    np.save(out.with_suffix(".npy"), np.asarray(image, np.float32))
    return {**result, "peak_mb": peak_mb()}


def _peer_image(contender: str, workload_name: str, vae: str, out: Path, args) -> dict:
    workload = WORKLOADS[workload_name]
    command = [str(peer_python(PEER_VENV)), str(HERE / "peer_run.py"), contender, "--model",
               str(model_dir(workload_name)), "--work", str(WORK / f"peers-{workload_name}"), "--latents",
               str(latents_file()), "--out", str(out), "--prompt", PROMPT, "--size", str(SIZE), "--steps",
               str(workload.steps), "--repeats", str(args.repeats), "--threads", str(args.threads), "--guidance",
               str(workload.guidance), *(["--taesd", str(taesd_dir())] if vae == "taesd" else [])]
    subprocess.run(command, check=True)
    result = json.loads(out.read_text())
    images = np.load(out.with_suffix(".npz"))
    np.save(out.with_suffix(".npy"), images[images.files[-1]])
    result["seconds"] = result["seconds"][str(workload.steps)]
    return result


def stage_model(target: str, args) -> dict:
    start = time.perf_counter()
    if target == "taesd":
        build_taesd()
    else:
        build_model(target)
    return {"seconds": time.perf_counter() - start, "peak_mb": peak_mb()}


STAGES = {"model": stage_model, "image": stage_image}


# ---- the run ------------------------------------------------------------------------------------------------


def _stem(tag: str = "") -> Path:
    suffix = f"-{tag}" if tag else ""
    return RESULTS / f"{datetime.date.today().isoformat()}-{socket.gethostname()}-realtime_cpu{suffix}"


def _run_stage(stage: str, target: str, args, log) -> dict:
    """One stage in a fresh process; a failure is recorded and the run goes on."""
    out = WORK / f"stage-{stage}-{target.replace(':', '-')}.json"
    out.unlink(missing_ok=True)
    log(f"stage {stage} {target}")
    command = [sys.executable, __file__, "--stage", stage, "--target", target, "--stage-json", str(out),
               "--threads", str(args.threads), "--repeats", str(args.repeats), *(["--smoke"] if args.smoke else [])]
    start = time.perf_counter()
    code = subprocess.run(command).returncode
    if code != 0 or not out.exists():
        return {"failed": True, "returncode": code, "wall_s": time.perf_counter() - start}
    return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - start}


def compare(report: dict) -> None:
    """PSNR and SSIM of each contender's image against diffusers' with the same workload and VAE."""
    from kasoku.core.parity import psnr, ssim

    for target, result in report.get("image", {}).items():
        workload, vae, contender = target.split(":")
        reference = WORK / "images" / f"{workload}-{vae}-diffusers.npy"
        mine = WORK / "images" / f"{workload}-{vae}-{contender}.npy"
        if contender == "diffusers" or result.get("failed") or not reference.exists() or not mine.exists():
            continue
        expected, actual = np.load(reference), np.load(mine)
        result["vs_diffusers"] = {"psnr_db": psnr(expected, actual), "ssim": ssim(expected, actual)}


def targets(args) -> list[str]:
    chosen = []
    for workload in args.workloads:
        for vae in args.vaes:
            for contender in args.contenders:
                if PEERS.get(contender, vae) == vae:
                    chosen.append(f"{workload}:{vae}:{contender}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), type=lambda t: t.split(","),
                        help=f"comma-separated: {', '.join(WORKLOADS)} (default: both)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), type=lambda t: t.split(","),
                        help=f"comma-separated: {', '.join(CONTENDERS)} (default: all; diffusers first: the "
                             "others are compared with it)")
    parser.add_argument("--vaes", default=",".join(VAES), type=lambda t: t.split(","),
                        help=f"comma-separated: {', '.join(VAES)} (default: both; the peers run only their own VAE)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="",
                        help="appended to the results' file name (…-realtime_cpu-TAG.md), so that runs of one day "
                             "with other workloads or contenders keep their own files")
    parser.add_argument("--smoke", action="store_true",
                        help=f"the tiny pipelines at 64x64 (a check of this script; results under {SMOKE_DIR})")
    parser.add_argument("--stage", choices=list(STAGES), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        use_smoke()
    unknown = [c for c in args.contenders if c not in CONTENDERS] + [w for w in args.workloads if w not in WORKLOADS] \
        + [v for v in args.vaes if v not in VAES]
    if unknown:
        parser.error(f"unknown contender, workload or VAE {unknown[0]!r}")
    WORK.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from kasoku.core.console import console, quiet_third_party_logs

    quiet_third_party_logs()
    torch.set_num_threads(args.threads)
    if args.stage:
        args.stage_json.write_text(json.dumps(STAGES[args.stage](args.target, args), indent=2, default=str))
        return 0

    def log(message: str) -> None:
        console.log(message, markup=False)

    log("measuring the fp32 matmul rate")
    report: dict = {"machine": machine_description(args.threads), "repeats": args.repeats}
    log(f"{report['machine']['cpu']} ({', '.join(report['machine']['flags']) or 'no AVX-512/AMX'}), "
        f"{args.threads} threads")
    if "amx_bf16" not in report["machine"]["flags"] and "avx512_bf16" not in report["machine"]["flags"]:
        log("this CPU has no bf16 instructions (AVX512-BF16, AMX): bf16 runs emulated, slower than fp32")
    for name in [*args.workloads, "taesd"]:
        folder = taesd_dir() if name == "taesd" else model_dir(name)
        if not (folder / ("config.json" if name == "taesd" else "model_index.json")).exists():
            report.setdefault("model", {})[name] = _run_stage("model", name, args, log)
    for target in targets(args):
        report.setdefault("image", {})[target] = _run_stage("image", target, args, log)
        compare(report)
        write(report, args.tag)
    console.print(_stem(args.tag).with_suffix(".md").read_text(), markup=False)
    return 0


def write(report: dict, tag: str = "") -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    _stem(tag).with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    _stem(tag).with_suffix(".md").write_text(markdown(report) + "\n")


# ---- the report ---------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = [
        "# kasoku realtime_cpu: few-step 512x512 images on a CPU, random weights",
        "",
        f"{machine['date']} · {machine['cpu']} ({', '.join(machine['flags']) or 'no AVX-512/AMX'}) · "
        f"{machine['threads']} threads · torch {machine['torch']} · fp32 matmul {machine['matmul_gflops']:.0f} "
        f"GFLOP/s · median of {report['repeats']} after a warm-up · each contender in its own process",
        "",
        "| workload | VAE | contender | s / image | min–max | vs diffusers | VAE share | text encoder share | "
        "not engines | PSNR / SSIM vs diffusers | cold compile s | peak RSS MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for target, result in report.get("image", {}).items():
        workload, vae, contender = target.split(":")
        spec = WORKLOADS[workload]
        label = f"{workload} ({spec.steps} step{'s' if spec.steps > 1 else ''}, guidance {spec.guidance:g})"
        if result.get("failed"):
            lines.append(f"| {label} | {vae} | {contender} | failed (exit {result['returncode']}) | | | | | | | | |")
            continue
        seconds = result["seconds"]
        median = statistics.median(seconds)
        base = report["image"].get(f"{workload}:{vae}:diffusers", {})
        ratio = f"{statistics.median(base['seconds']) / median:.2f}×" if base.get("seconds") else "—"
        share = result.get("share", {})
        parity = result.get("vs_diffusers")
        fidelity = f"{parity['psnr_db']:.1f} dB / {parity['ssim']:.3f}" if parity else "—"
        lines.append(
            f"| {label} | {vae} | {contender} | {median:.2f} | {min(seconds):.2f}–{max(seconds):.2f} | {ratio} | "
            f"{_pct(share.get('vae_decoder'))} | {_pct(share.get('text_encoder'))} | "
            f"{_pct(share.get('not_engines'))} | "
            f"{fidelity} | "
            f"{_num(result.get('compile_s', result.get('export_s')))} | {result.get('peak_mb', 0):.0f} |")
    lines += ["", "Columns: *s / image* is the median of the timed calls after a warm-up, *min–max* their range; "
              "*vs diffusers* is diffusers eager's median ÷ this one's (same workload and VAE); the shares are of "
              "the call's time (kasoku: its engines' times; diffusers: its torch modules'), *not engines* the rest "
              "(tokenizer, scheduler, copies); PSNR and SSIM against diffusers fp32's image from the same latents "
              "(openvino-genai draws its own noise from a seed: not comparable); *cold compile* kasoku's export "
              "and build into an empty cache (the peers: their export), *peak RSS* the process's."]
    shapes = {f"{t.split(':')[2]} on {t.split(':')[0]}": r["shapes"] for t, r in report.get("image", {}).items()
              if str(r.get("shapes", "static")).startswith("dynamic")}
    if shapes:
        lines += ["", "Shapes: " + "; ".join(f"{who}: {what}" for who, what in shapes.items()) + "."]
    return "\n".join(lines)


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _num(value) -> str:
    return "—" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    sys.exit(main())
