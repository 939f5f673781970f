"""Every command, given bad arguments, ends in one line and a non-zero exit: no traceback, nothing written.

The same checks hold in the Python API (a KasokuPipeline on the torch reference backend is built in
an instant, so these are unit tests)."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch

import kasoku
from kasoku.cli import main
from kasoku.pipeline.kasoku_pipeline import InvalidInput

BAD = {
    "tiny": [
        ["tiny", "{full}"],  # a folder that is not empty
        ["tiny", "{new}", "--family", "sd4"],
        ["tiny", "{new}", "--family", "flux", "--inpainting"],  # the tiny variants are the U-Net families'
        ["tiny", "{new}", "--family", "flux", "--lcm"],
        ["tiny", "{new}", "--seed", "-1"],
        ["tiny", "{file}"],
    ],
    "generate": [
        ["generate", "{model}", "a cat", "-o", "{out}", "--steps", "0"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--steps", "-3"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--height", "0"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--height", "60"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--width", "-64"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--num-images", "0"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--guidance", "nan"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--strength", "2", "--image", "{image}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--strength", "0.5"],  # nothing to move from
        ["generate", "{model}", "a cat", "-o", "{out}", "--backend", "torch", "--precision", "fp16"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--backend", "tensorrt"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--backend", "openvino", "--cuda-graph"],  # CPU backend
        ["generate", "{model}", "a cat", "-o", "{out}", "--backend", "onnxruntime", "--cuda-graph"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--backend", "inductor", "--cuda-graph"],  # no graph replay
        ["generate", "{model}", "a cat", "-o", "{out}", "--image", "{missing}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--mask", "{image}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--threads", "0"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--control-image", "{image}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--controlnet", "{controlnet}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--controlnet", "{missing}", "--control-image", "{image}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--controlnet", "{model}/unet", "--control-image", "{image}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--controlnet", "{controlnet}", "--control-image", "{small}",
         "--height", "64", "--width", "64"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--controlnet", "{controlnet}", "--control-image", "{image}",
         "--control-scale", "1", "--control-scale", "2"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--controlnet", "{controlnet}", "--control-image", "{image}",
         "--control-scale", "nan"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--guess-mode"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-interval", "0"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-interval", "-2"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-interval", "2.5"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-interval", "3", "--cache-schedule", "linear"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-interval", "3", "--cache-branch", "-1"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-interval", "3", "--cache-branch", "4"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-threshold", "-0.5"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-method", "magcache"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-threshold", "0.1"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--cache-interval", "2", "--cache-order", "2"],
        ["generate", "{missing}", "a cat", "-o", "{out}"],
        ["generate", "{model}", "a cat", "-o", "{new}/x.png"],
        ["generate", "{model}", "a cat", "-o", "{full}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--lora", "{missing}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--lora", "{file}:0.5"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--lora", "{file}:inf"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--lora-targets", "to q"],
        ["generate", "{model}", "a cat", "-o", "{noext}"],  # no image format in the name
        ["generate", "{model}", "a cat", "-o", "{file}/x.png"],  # a folder that is a file
        ["generate", "{model}", "a cat", "-o", "{out}", "--image", "{truncated}"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--seed", str(2**64)],
        ["generate", "{model}", "a \udcff cat", "-o", "{out}"],  # bytes that are not UTF-8, as argv carries them
        ["generate", "{model}", "a cat", "-o", "{out}", "--width", "100000", "--height", "64"],
        ["generate", "{model}", "a cat", "-o", "{out}", "--lora-targets", "nonsense"],
        ["generate", "{partial}", "a cat", "-o", "{out}"],  # a component folder missing
        ["generate", "{damaged}", "a cat", "-o", "{out}"],  # a truncated weights file
        ["generate", "{unweighted}", "a cat", "-o", "{out}"],  # the VAE's weights file missing
        ["generate", "{model}", "a cat", "-o", "{out}", "--prompt-3", "a dog"],  # SD3's argument, said before any work
        ["generate", "{model}", "a cat", "-o", "{out}", "--true-cfg", "2"],  # Flux's
        ["generate", "{model}", "a cat", "-o", "{out}", "--scheduler", "flow-euler"],  # another kind of noise
        ["generate", "{model}", "a cat", "-o", "{out}", "--prompt-3", "a long prompt"],  # SD3's, not SD 1.x's
    ],
    "batch": [
        ["batch", "{model}", "{jobs}", "--out", "{new}", "--batch-size", "0"],
        ["batch", "{model}", "{jobs}", "--out", "{new}", "--workers", "2"],
        ["batch", "{model}", "{missing}", "--out", "{new}"],
        ["batch", "{model}", "{bad_jobs}", "--out", "{new}"],
        ["batch", "{model}", "{jobs}", "--out", "{new}", "--backend", "torch", "--precision", "fp16"],
        ["batch", "{model}", "{jobs}", "--out", "{new}", "--height", "64:0"],
        ["batch", "{model}", "{jobs}", "--out", "{file}"],
        ["batch", "{model}", "{control_jobs}", "--out", "{new}"],
        ["batch", "{model}", "{jobs}", "--out", "{new}", "--controlnet", "{controlnet}"],
        ["batch", "{model}", "{lora_jobs}", "--out", "{new}"],
        ["batch", "{model}", "{bad_cache_jobs}", "--out", "{new}"],
        ["batch", "{model}", "{bad_method_jobs}", "--out", "{new}"],
        ["batch", "{model}", "{jobs}", "--out", "{new}", "--cache-branch", "-1"],
        ["batch", "{model}", "{huge_jobs}", "--out", "{new}"],
    ],
    "serve": [
        ["serve", "{model}", "--port", "70000"],
        ["serve", "{model}", "--max-batch", "0"],
        ["serve", "{model}", "--batch-window-ms", "-5"],
        ["serve", "{model}", "--max-queue", "0"],
        ["serve", "{model}", "--timeout", "0"],
        ["serve", "{model}", "--size", "64by64"],
        ["serve", "{model}", "--size", "60x64"],
        ["serve", "{model}", "--replicas", "2"],
        ["serve", "{model}", "--ray", "--port", "0"],
        ["serve", "{model}", "--api-key-env", "KASOKU_TEST_VARIABLE_THAT_IS_NOT_SET"],
        ["serve", "{model}", "--backend", "torch", "--precision", "fp16"],
        ["serve", "{missing}"],
    ],
    "export": [
        ["export", "{missing}", "{new}"],
        ["export", "{model}", "{file}"],
        ["export", "{model}", "{new}", "--components", "magic"],
    ],
    "compile": [
        ["compile", "{model}", "--height", "64:48"],
        ["compile", "{model}", "--batch", "0:2"],
        ["compile", "{model}", "--backend", "torch", "--precision", "fp16"],
        ["compile", "{model}", "--backend", "inductor", "--precision", "fp16"],  # a GPU precision for inductor
        ["compile", "{model}", "--backend", "inductor", "--precision", "int8"],
        ["compile", "{model}", "--threads", "0"],
        ["compile", "{model}", "--cuda-graph"],  # the default profile is a range: no one shape to capture
        ["compile", "{model}", "--cuda-graph", "--batch", "1:1", "--height", "64:64", "--width", "64:64"],  # guidance?
        ["compile", "{model}", "--trt-opt-level", "9"],
        ["compile", "{model}", "--components", "text_encoder_2"],
        ["compile", "{model}", "--lora-targets", ".to_q"],
        ["compile", "{model}", "--backend", "openvino", "--precision", "int8", "--lora-targets", "attention"],
        ["compile", "{model}", "--step-cache", "--cache-branch", "4"],
        ["compile", "{model}", "--cache-branch", "x"],
        ["compile", "{file}"],
        ["compile", "{model}", "--controlnet", "{missing}"],
    ],
    "cache": [
        ["cache", "frobnicate"],
        ["cache", "ls", "{model}"],
        ["cache", "ls", "--repair"],
        ["cache", "clear", "{missing}"],  # no such folder: said, not "removed 0 entries"
        ["cache", "clear", "{model}"],  # a model with no entries
        ["cache", "ls", "--cache-dir", "{file}"],  # KASOKU_CACHE or --cache-dir naming a file
        ["cache", "clear", "--cache-dir", "{file}"],
        ["cache", "check", "--cache-dir", "{file}"],
    ],
    "verify": [
        ["verify", "{model}", "--backend", "torch", "--precision", "fp16"],
        ["verify", "{missing}"],
        ["verify", "{model}", "--controlnet", "{model}"],
        ["verify", "{model}", "--cache-interval", "0"],
        ["verify", "{model}", "--cache-interval", "2", "--cache-schedule", "quadratic"],
    ],
    "bench": [
        ["bench", "{model}", "--repeats", "2"],
        ["bench", "{model}", "--repeats", "1"],
        ["bench", "{model}", "--backends", "magic"],
        ["bench", "{model}", "--steps", "0"],
        ["bench", "{model}", "--controlnet", "{file}"],
    ],
    "demo": [
        ["demo", "-o", "{new}/x.png"],
    ],
    "info": [
        ["info", "--bogus"],
    ],
}
# everything here can be checked before any work: the answer comes at once (imports already warm)
ANSWER_SECONDS = 5.0
CASES = [(command, args) for command, cases in BAD.items() for args in cases]


@pytest.fixture(scope="module")
def controlnet_folder(tmp_path_factory):
    from kasoku.tools.tiny import write_tiny_controlnet

    return write_tiny_controlnet(tmp_path_factory.mktemp("controlnet") / "controlnet")


@pytest.fixture
def places(tmp_path, tiny_dir, controlnet_folder):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("keep")
    (tmp_path / "file.txt").write_text("not a folder")
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "in.png")
    Image.new("RGB", (48, 64)).save(tmp_path / "small.png")
    (tmp_path / "jobs.jsonl").write_text(json.dumps({"prompt": "a cat"}) + "\n")
    (tmp_path / "control.jsonl").write_text(json.dumps({"prompt": "a cat", "control_image": "in.png"}) + "\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a cat", "steps": 0}\n')
    (tmp_path / "lora.jsonl").write_text(json.dumps({"prompt": "a cat", "loras": [str(tmp_path / "none")]}) + "\n")
    (tmp_path / "bad_cache.jsonl").write_text('{"prompt": "a cat", "cache_interval": 0}\n')
    (tmp_path / "bad_method.jsonl").write_text('{"prompt": "a cat", "cache_threshold": 0.1}\n')
    (tmp_path / "huge.jsonl").write_text('{"prompt": "a cat", "height": 64, "width": 100000}\n')
    (tmp_path / "truncated.png").write_bytes((tmp_path / "in.png").read_bytes()[:60])
    partial, damaged, unweighted = tmp_path / "partial", tmp_path / "damaged", tmp_path / "unweighted"
    shutil.copytree(tiny_dir, partial)
    shutil.rmtree(partial / "vae")
    shutil.copytree(tiny_dir, unweighted)
    for weights in (unweighted / "vae").glob("*.safetensors"):
        weights.unlink()
    shutil.copytree(tiny_dir, damaged)
    weights = next((damaged / "unet").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    return {"model": str(tiny_dir), "out": str(tmp_path / "out.png"), "new": str(tmp_path / "new"),
            "full": str(full), "file": str(tmp_path / "file.txt"), "image": str(tmp_path / "in.png"),
            "missing": str(tmp_path / "missing"), "jobs": str(tmp_path / "jobs.jsonl"),
            "bad_jobs": str(tmp_path / "bad.jsonl"), "bad_cache_jobs": str(tmp_path / "bad_cache.jsonl"),
            "bad_method_jobs": str(tmp_path / "bad_method.jsonl"),
            "cache": str(tmp_path / "cache"), "controlnet": str(controlnet_folder),
            "small": str(tmp_path / "small.png"),
            "control_jobs": str(tmp_path / "control.jsonl"), "lora_jobs": str(tmp_path / "lora.jsonl"),
            "noext": str(tmp_path / "out"), "truncated": str(tmp_path / "truncated.png"),
            "partial": str(partial), "damaged": str(damaged), "unweighted": str(unweighted),
            "huge_jobs": str(tmp_path / "huge.jsonl")}


def _tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size if p.is_file() else -1) for p in path.rglob("*"))


@pytest.mark.parametrize("command, args", CASES, ids=[f"{c}-{i}" for c, cases in BAD.items()
                                                       for i in range(len(cases))])
def test_bad_arguments_end_in_one_line_and_write_nothing(command, args, places, tmp_path, capsys):
    argv = [a.format(**places) for a in args]
    if argv[0] not in ("tiny", "info") and "--cache-dir" not in argv:
        argv += ["--cache-dir", places["cache"]]
    before = _tree(tmp_path)
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's parse errors
        code = exit_.code
    seconds = time.perf_counter() - start
    out = capsys.readouterr()
    text = out.out + out.err
    assert code not in (0, None), f"{argv} succeeded:\n{text}"
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "error" in lines[0], f"{argv} printed:\n{text}"
    assert _tree(tmp_path) == before, f"{argv} wrote files"
    assert seconds < ANSWER_SECONDS, f"{argv} took {seconds:.1f} s to refuse"


@pytest.fixture(scope="module")
def torch_pipeline(tiny_pipe, tmp_path_factory):
    """A KasokuPipeline on the torch reference backend: no export, built in an instant."""
    return kasoku.compile(tiny_pipe, "torch", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("kwargs, message", [
    ({"num_inference_steps": 0}, "`num_inference_steps` must be a positive int but is 0"),
    ({"num_inference_steps": -3}, "`num_inference_steps` must be a positive int but is -3"),
    ({"num_inference_steps": 2000}, "must be at most 999 for this scheduler"),
    ({"num_inference_steps": 1000}, "must be at most 999 for this scheduler"),  # PNDM's offset overruns at 1000
    ({"height": 0}, "`height` must be a positive int but is 0"),
    ({"width": -64}, "`width` must be a positive int but is -64"),
    ({"height": 60}, "must be multiples of 16 for this model"),
    ({"num_images_per_prompt": 0}, "`num_images_per_prompt` must be a positive int"),
    ({"guidance_scale": float("nan")}, "`guidance_scale` must be a finite number"),
    ({"prompt_2": "a dog"}, "`prompt_2`: only Stable Diffusion XL, Stable Diffusion 3 and Flux.1 pipelines take this "
                            "argument"),
    ({"max_sequence_length": 77}, "`max_sequence_length`: only Stable Diffusion 3 and Flux.1 pipelines take this"),
    ({"cache_interval": 0}, "`cache_interval` must be a positive int (1: every step computed in full, no "
                            "caching) but is 0"),
    ({"cache_threshold": -1}, "`cache_threshold` must be a number >= 0"),
    ({"cache_method": "magcache"}, "`cache_method` must be one of deepcache, taylorseer, first-block"),
    ({"cache_threshold": 0.1}, "`cache_method` 'first-block': this denoiser runs deepcache, taylorseer"),
    ({"cache_order": 2}, "`cache_order` and `cache_warmup` are TaylorSeer's"),
    ({"cache_interval": 2, "cache_order": 2}, "`cache_order` is not read by the deepcache cache"),
    ({"cache_interval": -2}, "`cache_interval` must be a positive int"),
    ({"cache_interval": 2.0}, "`cache_interval` must be a positive int"),
    ({"cache_interval": 3, "cache_schedule": "linear"}, "`cache_schedule` must be one of uniform, nonuniform but "
                                                         "is 'linear'"),
])
def test_python_api_refuses_the_same_values(torch_pipeline, kwargs, message):
    calls_before = dict(torch_pipeline.times.calls)
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        torch_pipeline("a cat", generator=torch.Generator().manual_seed(0), **kwargs)
    assert dict(torch_pipeline.times.calls) == calls_before  # no engine ran


@pytest.mark.parametrize("call, message", [
    ({"prompt": b"a \xff cat"}, r"`prompt` must be a str or a list of str but holds bytes; decode them first"),
    ({"prompt": 5}, r"`prompt` must be a str or a list of str but holds 5 \(int\)"),
    ({"prompt": "a \udcff cat"}, r"`prompt` holds '\\udcff' at 2, which is not text \(a lone surrogate"),
    ({"prompt": "a cat", "negative_prompt": ["x", 3]}, r"`negative_prompt` must be a str or a list of str but holds 3"),
    ({"prompt": "a cat", "latents": torch.zeros(1, 4, 4, 4)},
     r"`latents` has shape \(1, 4, 4, 4\) but this call \(1 image\(s\) of 64x64\) takes \(1, 4, "),
    ({"prompt": "a cat", "image": np.full((64, 64, 3), np.nan, np.float32), "strength": 0.5},
     r"`image` holds NaN or infinite values"),
])
def test_python_api_refuses_inputs_diffusers_cannot_take_in_one_line(torch_pipeline, call, message):
    """Each is refused before anything runs, in one line: not a tokenizer's TypeError, nor advice to widen the
    profile, nor a broken engine output."""
    calls_before = dict(torch_pipeline.times.calls)
    with pytest.raises(InvalidInput, match=message) as refused:
        torch_pipeline(generator=torch.Generator().manual_seed(0), num_inference_steps=2, **call)
    assert "\n" not in str(refused.value) and dict(torch_pipeline.times.calls) == calls_before


def test_img2img_with_no_denoising_step_is_refused(torch_pipeline):
    from PIL import Image

    with pytest.raises(InvalidInput, match="at least 1 step of denoising but is 3 x 0.1"):
        torch_pipeline("a cat", image=Image.new("RGB", (64, 64)), strength=0.1, num_inference_steps=3)


def test_verify_and_bench_are_public():
    assert callable(kasoku.verify) and callable(kasoku.bench) and callable(kasoku.compile)
    assert kasoku.CompileOptions().backend == "auto"


# Refused from the folder's configs alone, before diffusers is imported: each prints whether it was
CONFIG_ERRORS = [
    (["--height", "60"], "must be multiples of 16"),
    (["--height", "4096"], "more than this model serves"),
    (["--prompt-3", "a dog"], "`--prompt-3`: only Stable Diffusion 3 pipelines take this argument"),
    (["--true-cfg", "2"], "`--true-cfg`: only"),
]
_RUN_AND_SAY_IF_DIFFUSERS_LOADED = ("import sys\nfrom kasoku.cli import main\ncode = main(sys.argv[1:])\n"
                                    "print('diffusers imported:', 'diffusers' in sys.modules)\nsys.exit(code)")


def test_errors_from_configs_answer_in_seconds_of_cpu(tiny_dir, tmp_path):
    """A new process as a user starts it (interpreter, imports and all): a size off the model's step, beyond its
    bound, or another family's argument is refused from the configs with under 5 s of CPU work, before diffusers is
    imported, with one line and nothing written. The bound is on the process's CPU seconds (about 2.6 s here), which
    a busy machine does not change: its wall time is those over the share of the cores it gets (5.0-5.8 s with every
    core busy), so a wall-time bound would measure the machine's load, not kasoku."""
    import resource
    import subprocess
    import sys

    def children_cpu_seconds() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    for extra, message in CONFIG_ERRORS:
        argv = ["generate", str(tiny_dir), "a cat", "-o", str(tmp_path / "out.png"),
                "--cache-dir", str(tmp_path / "cache"), *extra]
        start = children_cpu_seconds()
        done = subprocess.run([sys.executable, "-c", _RUN_AND_SAY_IF_DIFFUSERS_LOADED, *argv],
                              capture_output=True, text=True, timeout=120)
        seconds = children_cpu_seconds() - start
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert done.returncode == 1 and len(lines) == 2, f"{extra}: {done.stdout}{done.stderr}"
        assert lines[0].startswith("error:") and message in lines[0], lines[0]
        assert lines[1] == "diffusers imported: False"
        assert seconds < ANSWER_SECONDS, f"{extra} took {seconds:.1f} s of CPU to refuse"
        assert list(tmp_path.iterdir()) == []
