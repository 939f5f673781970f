"""Whole images of the newest families at full size (random weights): Sana Sprint 0.6B and 1.6B at 1024x1024 in one
step, Flux.2 klein 4B at 512x512 in four, end to end, through diffusers (fp32, bf16), kasoku
(`KasokuPipeline.from_pretrained` on the folder, as a user runs it) and optimum-intel's OpenVINO pipeline (in its
own environment), with the time of each stage.

    python benchmarks/full_modern_image.py [--family sana-0.6b] [--size 1024] [--steps 1]
        [--contenders diffusers:fp32,diffusers:bf16,kasoku:bf16,kasoku:int8,optimum-intel:default] [--repeats 2]
        [--kasoku-reads fp32|bf16]
    python benchmarks/full_modern_image.py --family flux2-klein-4b --size 512 --steps 4 \
        --contenders kasoku:bf16,diffusers:bf16

`--family sana-0.6b-lite` is Sana Sprint 0.6B with DC-AE-Lite, the lighter decoder its authors publish for it.
Flux.2 klein 4B's folder is written and read in bf16 by every contender (its fp32 weights, 32 GB, do not fit in
24 GiB): its images are compared with diffusers' bf16 image, and its FLOPs counted there. `--kasoku-reads bf16` has
kasoku read a Sana folder in bf16 too (`torch_dtype=torch.bfloat16`: its bf16 engines then hold bf16 weights).

The pipeline folder is written once (benchmarks/.models/modern-image/<family>-pipeline, fp32 safetensors: 14 GB for
Sana Sprint 0.6B) from the configurations benchmarks/full_modern.py names, with seeded random weights. Gemma's own
tokenizer cannot be downloaded here, so the folder's is a word-level one over the words of Sana's instruction
prefix and the prompts: its token counts are close to a real tokenizer's (one per word or punctuation run), and the
report gives the text encoder's token count. Every contender runs the same folder, prompt, initial latents and
threads, each in its own process; the image of each is compared with diffusers' fp32 image (PSNR).

Contenders:
- `diffusers:fp32`, `diffusers:bf16`: diffusers' own pipeline (`torch_dtype`), the FLOPs of each stage counted by
  torch in the fp32 run's warm-up (the time ÷ FLOP floor column).
- `kasoku:bf16`, `kasoku:int8`: `KasokuPipeline.from_pretrained(folder, backend="openvino", precision=...,
  profile=<this exact shape>)`, a cold compile (timed: the recording of the pipeline's calls, exports, builds), then
  the calls; then the same from the warm cache in a new process (timed: what every later start costs). The first
  kasoku contender starts from an empty cache (`--keep-cache`: from the one an earlier run left); the next reuses its
  recording and graphs, as a user's second precision does (the report says which started empty). int8 is kasoku's per
  component: the denoiser's and text encoder's weights in int8, the VAE in bf16. `kasoku:int8-decoder` is int8 with
  the VAE decoder's activations in int8 too (`int8_activations=("vae_decoder",)`: calibrated on the images the
  pipeline decodes, its convolutions in int8). `kasoku:int4-text` and `kasoku:int4-text-decoder` are `int8` and
  `int8-decoder` with the LLM text encoder's weights in int4 (`int4_weights=("text_encoder",)`).
- `optimum-intel:default`: `optimum-cli export openvino` of the same folder (timed) and its OVDiffusionPipeline with
  its defaults (benchmarks/peer_modern.py, in benchmarks/.peers/optimum-intel, made when missing).
- `openvino-genai:default`: openvino.genai's Text2ImagePipeline on that export, its defaults; it takes a seed, not
  latents, so its image starts from its own noise (no PSNR). openvino.genai 2026.4 has no Sana pipeline (its
  Text2ImagePipeline runs Flux.2 klein, Z-Image and Qwen-Image).
- `stable-diffusion-cpp:default`, `stable-diffusion-cpp:q8_0` (Flux.2 klein only: stable-diffusion.cpp has no Sana):
  stable-diffusion.cpp's Python bindings (benchmarks/peer_sdcpp.py, in benchmarks/.peers/stable-diffusion-cpp, a C++
  build of the registry's source distribution made when missing: about 12 minutes on 2 cores), the weights as the
  folder holds them (bf16) or quantized to its 8-bit blocks as it loads them; its own noise from a seed (no PSNR).

Writes benchmarks/results/<date>-<host>-full_modern_image[-TAG].md/.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from full_modern import FAMILIES, SEED, use_smoke_model, write_results  # noqa: E402 - the published configurations, one place
from full_sd15 import peer_python  # noqa: E402 - the peers' environments
from full_sd35 import _peak_mb, _run_stage  # noqa: E402

WORK = HERE / ".models" / "modern-image"
RESULTS = HERE / "results"
PROMPT = "a red fox in the snow at dawn, soft light, detailed fur"
DEFAULT_CONTENDERS = "diffusers:fp32,diffusers:bf16,kasoku:bf16,kasoku:int8,optimum-intel:default"
# kasoku's int8 contenders: (the VAE decoder's precision, int8_activations, int4_weights); the text encoder and the
# transformer are int8 in each
INT8_VARIANTS = {"int8": ("bf16", (), ()), "int8-decoder": ("int8", ("vae_decoder",), ()),
                 "int4-text": ("bf16", (), ("text_encoder",)),
                 "int4-text-decoder": ("int8", ("vae_decoder",), ("text_encoder",))}
STAGES = {"text_encoder": ("text_encoder", "forward"), "transformer": ("transformer", "forward"),
          "vae_decoder": ("vae", "decode")}
PEER_ENV = "optimum-intel"  # optimum-intel and openvino.genai, in one environment
SDCPP_ENV = "stable-diffusion-cpp"
PEERS = ("optimum-intel", "openvino-genai", "stable-diffusion-cpp")


# ---- the model folder --------------------------------------------------------------------------------------


def _instruction() -> str:
    """Sana's instruction prefix, as its pipeline joins it in front of every prompt."""
    import inspect

    from diffusers import SanaSprintPipeline

    return "\n".join(inspect.signature(SanaSprintPipeline.__call__).parameters["complex_human_instruction"].default)


def word_tokenizer():
    """A word-level tokenizer (Gemma's BOS first, its pad, EOS and unknown ids) over the words of Sana's instruction
    and the prompt: one token per word or punctuation run, as a real subword tokenizer gives about."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(re.findall(r"\w+|[^\w\s]+", f"{_instruction()} {PROMPT}")))
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
    # the length Sana's pipeline pads every prompt to (its instruction's tokens + max_sequence_length 300 - 2): what
    # optimum-intel's static reshape gives the text encoder (it leaves a Gemma tokenizer's dynamic)
    fast.model_max_length = len(fast.encode(_instruction())) + 300 - 2
    return fast


def pipeline_folder(family: str, work: Path) -> Path:
    """The family's whole pipeline with seeded random weights, written once."""
    folder = work / f"{family}-pipeline"
    if (folder / "model_index.json").exists():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    torch.manual_seed(SEED)
    (_write_flux2_klein if family.startswith("flux2") else _write_sana)(FAMILIES[family], partial)
    partial.rename(folder)
    return folder


def _write_sana(config, folder: Path) -> None:
    import diffusers as d
    import transformers as tr

    text = {k: v for k, v in config.text_encoder.items() if k not in ("kind", "max_tokens")}
    pipe = d.SanaSprintPipeline(
        tokenizer=word_tokenizer(), scheduler=d.SCMScheduler(),
        text_encoder=tr.Gemma2Model(tr.Gemma2Config(**text, pad_token_id=0, bos_token_id=2, eos_token_id=1)).eval(),
        vae=d.AutoencoderDC(**config.vae).eval(), transformer=d.SanaTransformer2DModel(**config.transformer).eval())
    pipe.save_pretrained(folder)


def _write_flux2_klein(config, folder: Path) -> None:
    """Flux.2 klein 4B in bf16 (its fp32 weights, 32 GB, fit neither this disk's budget nor its memory), one component
    at a time; the tokenizer is kasoku's small Qwen BPE with Qwen's chat template (the pipeline pads every prompt to
    its 512 tokens, so the text encoder's work is the real one); klein 4B is step-distilled (no guidance)."""
    import diffusers as d
    import transformers as tr

    from kasoku.tools.tiny_families import qwen_tokenizer

    text = {k: v for k, v in config.text_encoder.items() if k not in ("kind", "max_tokens")}
    parts = {"transformer": lambda: d.Flux2Transformer2DModel(**config.transformer),
             "text_encoder": lambda: tr.Qwen3ForCausalLM(tr.Qwen3Config(**text, tie_word_embeddings=False)),
             "vae": lambda: d.AutoencoderKLFlux2(**config.vae)}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        for name, build in parts.items():
            module = build().eval()
            module.save_pretrained(folder / name)
            del module
    finally:
        torch.set_default_dtype(default)
    qwen_tokenizer().save_pretrained(folder / "tokenizer")
    d.FlowMatchEulerDiscreteScheduler().save_pretrained(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "Flux2KleinPipeline", "_diffusers_version": d.__version__,
        "is_distilled": True, "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"]},
        indent=2))


def reads_bf16(family: str) -> bool:
    """Whether every contender reads the folder in bf16: Flux.2 klein 4B's fp32 weights (32 GB) do not fit."""
    return family.startswith("flux2")


def kasoku_reads_bf16(args) -> bool:
    """Whether kasoku reads the folder in bf16: where every contender does, or where `--kasoku-reads bf16` asks it
    (its bf16 graphs then hold bf16 weights: half the memory of the engines built from fp32)."""
    return reads_bf16(args.family) or args.kasoku_reads == "bf16"


def latents_file(family: str, size: int, work: Path) -> Path:
    """The initial latents every contender starts from (seed 0): Sana's at 1/32 of the image, Flux.2's 128
    channels at 1/16 (its pipeline packs them)."""
    path = work / f"{family}-latents-{size}.npy"
    if not path.exists():
        channels = FAMILIES[family].transformer["in_channels"]
        side = size // (16 if family.startswith("flux2") else 32)
        np.save(path, torch.randn((1, channels, side, side), generator=torch.Generator().manual_seed(0)).numpy())
    return path


def call_arguments(args, latents: np.ndarray) -> dict[str, Any]:
    """The call every contender makes: Sana Sprint's one step runs without SCM's intermediate timestep."""
    sana = {"intermediate_timesteps": None} if args.family.startswith("sana") and args.steps != 2 else {}
    return {"prompt": PROMPT, "height": args.size, "width": args.size, "num_inference_steps": args.steps,
            "latents": torch.from_numpy(latents), "output_type": "np", **sana}


# ---- timing each stage ---------------------------------------------------------------------------------------


class StageClock:
    """Seconds in each stage's method (text encoder, transformer, VAE decode) of a diffusers-style pipeline, wrapped
    on the instances; with `count_flops`, the FLOPs of the next call of each."""

    def __init__(self, pipe):
        self.seconds: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self.tokens: int | None = None
        self.counting = False
        for stage, (attribute, method) in STAGES.items():
            owner = getattr(pipe, attribute)
            setattr(owner, method, self._timed(stage, getattr(owner, method)))

    def _timed(self, stage: str, original):
        def run(*args, **kwargs):
            if stage == "text_encoder":
                ids = kwargs.get("input_ids", args[0] if args else None)
                self.tokens = int(ids.shape[-1]) if ids is not None else None
            start = time.perf_counter()
            if self.counting:
                from torch.utils.flop_counter import FlopCounterMode

                with FlopCounterMode(display=False) as counter:
                    out = original(*args, **kwargs)
                self.flops[stage] = self.flops.get(stage, 0.0) + counter.get_total_flops()
            else:
                out = original(*args, **kwargs)
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
            return out
        return run

    def reset(self) -> None:
        self.seconds = {}


def timed_calls(pipe, clock: StageClock, call: dict, repeats: int, count_flops: bool = False) -> dict:
    """A warm-up call, then `repeats` timed ones: seconds per call and per stage, and the last image."""
    clock.counting = count_flops
    start = time.perf_counter()
    pipe(**call)
    first = time.perf_counter() - start
    clock.counting = False
    seconds, stages, image = [], [], None
    for _ in range(repeats):
        clock.reset()
        start = time.perf_counter()
        image = pipe(**call).images[0]
        seconds.append(time.perf_counter() - start)
        stages.append(dict(clock.seconds))
    return {"first_call_s": first, "seconds": seconds, "stages": stages, "image": np.asarray(image, np.float32),
            "text_tokens": clock.tokens}


# ---- stages (each in its own process) ------------------------------------------------------------------------


def stage_diffusers(args, precision: str) -> dict:
    from diffusers import DiffusionPipeline

    folder = pipeline_folder(args.family, args.work)
    start = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32 if precision == "fp32" else
                                             torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - start
    latents = np.load(latents_file(args.family, args.size, args.work))
    call = call_arguments(args, latents)
    call["latents"] = call["latents"].to(pipe.dtype)
    clock = StageClock(pipe)
    with torch.no_grad():  # not inference_mode: torch's FLOP counter tracks modules through autograd
        result = timed_calls(pipe, clock, call, args.repeats,
                             count_flops=precision == ("bf16" if reads_bf16(args.family) else "fp32"))
    return {"load_s": load_s, **result, "flops_per_stage": clock.flops}


def stage_kasoku(args, precision: str) -> dict:
    import kasoku
    from kasoku.core.components import ImageShape, ShapeProfile

    folder = pipeline_folder(args.family, args.work)
    cache = args.work / "cache-kasoku"  # one cache, as a user's: a second precision reuses the recording and graphs
    if args.fresh_cache:
        shutil.rmtree(cache, ignore_errors=True)
    components = ("text_encoder", "transformer", "vae_decoder")
    chosen, activations, int4 = precision, (), ()
    if precision in INT8_VARIANTS:
        decoder, activations, int4 = INT8_VARIANTS[precision]
        chosen = {"text_encoder": "int8", "transformer": "int8", "vae_decoder": decoder}
    profile = ShapeProfile.exact(ImageShape(1, args.size, args.size), guidance=False, multiple=32)
    read = {"torch_dtype": torch.bfloat16} if kasoku_reads_bf16(args) else {}
    start = time.perf_counter()
    pipe = kasoku.KasokuPipeline.from_pretrained(folder, backend="openvino", precision=chosen, profile=profile,
                                                 components=components, cache_dir=cache, threads=args.threads,
                                                 int8_activations=activations, int4_weights=int4, **read)
    compile_s = time.perf_counter() - start
    pipe.set_progress_bar_config(disable=True)
    peak_compile = _peak_mb()
    latents = np.load(latents_file(args.family, args.size, args.work))
    clock = StageClock(pipe)
    result = timed_calls(pipe, clock, call_arguments(args, latents), args.repeats)
    report = pipe.compile_report
    return {"compile_s": compile_s, "peak_mb_compile": peak_compile, **result,
            "backends": report.backends, "precisions": report.precisions,
            "compile_stages": [[s.component, s.stage, s.status, round(s.seconds, 1)] for s in report.stages],
            "notes": report.notes}


class PeerFailed(RuntimeError):
    """A peer's run ended with an error it wrote down (its export stopped by the memory watchdog, say)."""


def stage_peer(args, runner: str, precision: str) -> dict:
    out = args.work / "peer" / ("result.json" if runner == "optimum-intel" else f"result-{runner}-{precision}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    folder = pipeline_folder(args.family, args.work)
    common = ["--model", str(folder), "--prompt", PROMPT, "--size", str(args.size), "--steps", str(args.steps),
              "--repeats", str(args.repeats), "--threads", str(args.threads), "--out", str(out)]
    if runner == "stable-diffusion-cpp":
        if not args.family.startswith("flux2"):
            raise PeerFailed(f"stable-diffusion.cpp has no pipeline for {FAMILIES[args.family].title}")
        ran = subprocess.run([str(peer_python(SDCPP_ENV)), str(HERE / "peer_sdcpp.py"), "--weights", precision,
                              "--work", str(args.work / "peer-sdcpp"), *common])
    else:
        ran = subprocess.run([str(peer_python(PEER_ENV)), str(HERE / "peer_modern.py"), "--runner", runner,
                              "--work", str(args.work / "peer"),
                              "--latents", str(latents_file(args.family, args.size, args.work)), *common])
    if not out.exists():
        raise subprocess.CalledProcessError(ran.returncode, ran.args)
    result = json.loads(out.read_text())
    if result.get("failed"):
        raise PeerFailed(result["error"])
    result["image"] = np.load(out.with_suffix(".npy"))
    return result


def run_stage(args) -> dict:
    kind, _, precision = args.contender.partition(":")
    torch.set_num_threads(args.threads)
    if kind == "diffusers":
        result = stage_diffusers(args, precision)
    elif kind == "kasoku":
        result = stage_kasoku(args, precision)
    else:
        result = stage_peer(args, kind, precision)
    image = result.pop("image")
    np.save(args.work / f"image-{args.contender.replace(':', '-')}{'-warm' if args.warm else ''}.npy", image)
    result["peak_mb"] = max(_peak_mb(), result.get("peak_mb", 0.0))
    return result


# ---- the report ----------------------------------------------------------------------------------------------


def _psnr(reference: np.ndarray, image: np.ndarray) -> float:
    from kasoku.core.parity import psnr

    return psnr(reference, image)


def reference_contender(family: str) -> str:
    """What every image is compared with, and the FLOPs counted in: diffusers in fp32, or in bf16 where the folder
    is read in bf16."""
    return "diffusers:bf16" if reads_bf16(family) else "diffusers:fp32"


def markdown(report: dict) -> str:
    runs = report["contenders"]
    ref_name = reference_contender(report["family"])
    base = runs.get(ref_name, {})
    flops = base.get("flops_per_stage") or {}
    rate = report["matmul_gflops"] * 1e9
    peers = [statistics.median(r["seconds"]) for name, r in runs.items() if name.startswith(PEERS) and
             not r.get("failed")]
    fastest_peer = min(peers) if peers else None
    lines = [f"# kasoku full_modern_image: {FAMILIES[report['family']].title} {report['size']}x{report['size']}, "
             f"{report['steps']} step(s), whole image, random weights", "",
             f"{report['date']} · {report['cpu']} ({', '.join(report['flags']) or 'no AVX-512/AMX'}) · "
             f"{report['threads']} threads · torch {report['torch']} · fp32 matmul {report['matmul_gflops']:.0f} "
             f"GFLOP/s · median of {report['repeats']} after a warm-up · each contender in its own process · kasoku "
             f"reads the weights in {report.get('kasoku_reads', 'fp32')}", "",
             "| contender | image s (median, min–max) | text encoder s | transformer s | VAE decode s | vs "
             f"{ref_name} | vs fastest peer | PSNR vs {ref_name} | cold start s | warm start s | peak RSS GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    reference = statistics.median(base["seconds"]) if base and not base.get("failed") else None
    for name, run in runs.items():
        if run.get("failed"):
            lines.append(f"| {name} | failed (exit {run['returncode']}): {run.get('error', '')} | | | | | | | | | |")
            continue
        median = statistics.median(run["seconds"])
        stage = {s: statistics.median(r.get(s, 0.0) for r in run["stages"]) for s in STAGES}
        cold = run.get("compile_s", run.get("export_s", run.get("load_s")))
        warm = run.get("warm_start_s", run.get("load_s") if not name.startswith("kasoku") else None)
        cells = [f"{median:.2f} ({min(run['seconds']):.2f}–{max(run['seconds']):.2f})"]
        cells += [f"{stage[s]:.2f}" + (f" ({stage[s] / (flops[s] / rate):.2f}× floor)" if flops.get(s) else "")
                  for s in STAGES]
        cells.append(f"{reference / median:.2f}×" if reference else "—")
        cells.append(f"{fastest_peer / median:.2f}×" if fastest_peer else "—")
        cells.append(f"{run['psnr_db']:.1f} dB" if run.get("psnr_db") is not None else
                     "— (its own noise)" if run.get("own_noise") else "—")
        started = ("" if not name.startswith("kasoku") else " (empty cache)" if run.get("empty_cache") else
                   " (its recording and graphs cached)")
        cells.append(f"{cold:.0f}{started}" if cold is not None else "—")
        cells.append(f"{warm:.1f}" if warm is not None else "—")
        cells.append(f"{run['peak_mb'] / 1024:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    tokens = base.get("text_tokens")
    lines += ["", f"FLOPs counted by torch in {ref_name}'s warm-up: "
              + ", ".join(f"{s} {flops[s] / 1e12:.2f} TFLOP" for s in STAGES if flops.get(s))
              + f"; floor = FLOPs / the fp32 matmul rate. The text encoder ran on {tokens} tokens." if flops else ""]
    for name, run in runs.items():
        if isinstance(run.get("static"), dict) and run["static"].get("failed"):
            lines.append(f"- {name}: its static reshape cannot run this call ({run['static']['failed']}); the row is "
                         "its default dynamic pipeline.")
        if run.get("versions"):
            lines.append(f"- {name}: {run.get('class')}, " + ", ".join(f"{k} {v}" for k, v in run["versions"].items())
                         + (f"; export {run['export_s']:.0f} s" if run.get("export_s") is not None else
                            "; its files written by an earlier run")
                         + (f", its peak {run['export_peak_mb'] / 1024:.1f} GiB" if run.get("export_peak_mb") else "")
                         + (f"; weights {run['weights']}" if run.get("weights") else ""))
        if run.get("precisions"):
            # a calibration's own builds ("calibration engine", ...) are inside its "calibrate" stage's seconds
            built = sum(seconds for _c, stage, _status, seconds in run.get("compile_stages", [])
                        if not stage.startswith("calibration "))
            lines.append(f"- {name}: " + ", ".join(f"{c} {run['backends'].get(c)} {p}" for c, p in
                                                   run["precisions"].items())
                         + f"; cold start {run['compile_s']:.0f} s, of which exports, calibration and engine builds "
                         f"{built:.0f} s (" + ", ".join(f"{c} {stage} {seconds:.0f} s" for c, stage, _status, seconds
                                                        in run.get("compile_stages", []))
                         + "), the rest recording the pipeline's calls and loading; peak RSS while compiling "
                         f"{run['peak_mb_compile'] / 1024:.1f} GiB"
                         + "".join(f"; {note}" for note in run.get("notes", [])))
    lines += [f"- {note}" for note in report.get("notes", [])]
    return "\n".join(lines)


def write_report(report: dict) -> None:
    write_results(RESULTS, "full_modern_image", report, markdown(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--family", default="sana-0.6b",
                        choices=[f for f in FAMILIES if f.startswith(("sana", "flux2"))])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help="KIND:PRECISION, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--work", type=Path, default=WORK, help="the model folder, caches and images (~40 GB disk)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--kasoku-reads", choices=("fp32", "bf16"), default="fp32",
                        help="the dtype kasoku reads the folder's weights in (Flux.2 klein: always bf16)")
    parser.add_argument("--reuse", type=lambda text: [c for c in text.split(",") if c], default=[],
                        help="contenders an earlier run in --work measured (its report.json), read instead of run: "
                             "e.g. --reuse diffusers:fp32,optimum-intel:default --contenders kasoku:int8")
    parser.add_argument("--keep-cache", action="store_true",
                        help="the first kasoku contender starts from the kasoku cache an earlier run left in --work "
                             "(its recording, graphs and engines), not from an empty one: its cold start then says "
                             "so (default: empty, a user's first compile)")
    parser.add_argument("--smoke", action="store_true", help="toy widths at 256x256 (a check of this script; results "
                                                              "under /tmp/kasoku-full_modern_image-smoke)")
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fresh-cache", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        global RESULTS
        use_smoke_model()
        smoke = Path("/tmp/kasoku-full_modern_image-smoke")
        args.work, RESULTS = (smoke / "work" if args.work == WORK else args.work), smoke / "results"

    from kasoku.core.console import quiet_third_party_logs

    quiet_third_party_logs()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.contender:
        from kasoku.core.errors import KasokuError

        try:
            result = run_stage(args)
        except (KasokuError, PeerFailed) as error:  # refused or stopped (memory, say): the report says why
            args.stage_json.write_text(json.dumps({"failed": True, "returncode": 1, "error": str(error)}))
            print(f"{args.contender} stopped: {error}")
            return 1
        args.stage_json.write_text(json.dumps(result, indent=2, default=str))
        return 0

    from kasoku.backends.base import cpu_flags, cpu_name
    from kasoku.tools.benchmark import matmul_gflops

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    log(f"CPU: {cpu_name()} ({', '.join(cpu_flags()) or 'no AVX-512/AMX'}); writing the model folder if missing")
    pipeline_folder(args.family, args.work)
    report = {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "cpu": cpu_name(),
              "flags": cpu_flags(), "threads": args.threads, "torch": torch.__version__, "repeats": args.repeats,
              "matmul_gflops": matmul_gflops(), "family": args.family, "size": args.size, "steps": args.steps,
              "tag": args.tag, "kasoku_reads": "bf16" if kasoku_reads_bf16(args) else "fp32", "contenders": {},
              "notes": []}
    common = ["--family", args.family, "--size", str(args.size), "--steps", str(args.steps), "--repeats",
              str(args.repeats), "--threads", str(args.threads), "--work", str(args.work),
              "--kasoku-reads", args.kasoku_reads,
              *(["--smoke"] if args.smoke else [])]
    fresh = [] if args.keep_cache else ["--fresh-cache"]  # the first kasoku contender starts from an empty cache
    for contender in args.reuse:  # measured by an earlier run in this work folder: read, not run again
        report["contenders"][contender] = json.loads((args.work / "report.json").read_text())["contenders"][contender]
    for contender in args.contenders.split(","):
        name = contender.replace(":", "-")
        cold = fresh if contender.startswith("kasoku") else []
        fresh = fresh if not cold else []
        run = _run_stage(["--contender", contender, *cold, *common], name, args.work, log, script=__file__)
        run["empty_cache"] = bool(cold)
        if contender.startswith("kasoku") and not run.get("failed"):
            warm = _run_stage(["--contender", contender, "--warm", *common], f"{name}-warm", args.work, log,
                              script=__file__)
            run["warm_start_s"] = warm.get("compile_s")
            run["warm_run"] = warm
        report["contenders"][contender] = run
        _compare_images(report, args.work)
        write_report(report)
        (args.work / "report.json").write_text(json.dumps(report, indent=2))
    # the floor's rate measured again at the end (the first can be low: the folder's 14 GB are being written back)
    report["matmul_gflops"] = max(report["matmul_gflops"], matmul_gflops())
    write_report(report)
    (args.work / "report.json").write_text(json.dumps(report, indent=2))
    return 0


def _compare_images(report: dict, work: Path) -> None:
    reference = work / f"image-{reference_contender(report['family']).replace(':', '-')}.npy"
    if not reference.exists():
        return
    expected = np.load(reference)
    for name, run in report["contenders"].items():
        image = work / f"image-{name.replace(':', '-')}.npy"
        if not run.get("failed") and not run.get("own_noise") and image.exists() and \
                name != reference_contender(report["family"]):
            run["psnr_db"] = _psnr(expected, np.load(image))


if __name__ == "__main__":
    sys.exit(main())
