"""ControlNet on compiled engines: each of diffusers' six ControlNet pipelines (SD 1.x and SDXL; txt2img,
img2img, inpaint) gives diffusers' own image from the same generator; several ControlNets with their own
scales, guess mode and a control-guidance window too; the ControlNet and the residual-taking U-Net are
described by their families, go through the cache, every CPU backend, verify, bench and batch; bad control
inputs are refused before any engine runs.

The engines are compiled once per module (ONNX Runtime, into the session cache) and shared."""

from __future__ import annotations

import hashlib
import json

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import kasoku
from kasoku.architectures.controlnet import UnfitControlNet
from kasoku.architectures.unet import controlnet_residuals
from kasoku.cli import main
from kasoku.core.components import Precision
from kasoku.core.parity import TOLERANCES, psnr
from kasoku.families import FAMILIES, TASKS
from kasoku.model.pipeline_model import Model, component_specs
from kasoku.pipeline.kasoku_pipeline import InvalidInput

integration = pytest.mark.integration  # exports or builds engines

MIN_PSNR = TOLERANCES[Precision.FP32].image_psnr_db
MAX_ABS = 1e-3
SIZE = 64
STEPS = 3
PROMPTS = ["a photo of an astronaut riding a horse", "a watercolor painting of a cat"]
NEGATIVE = ["blurry", "ugly"]
# diffusers' own ControlNet pipelines per family and task: the reference, named here rather than asked of kasoku.
DIFFUSERS = {
    "sd1": {"txt2img": "StableDiffusionControlNetPipeline", "img2img": "StableDiffusionControlNetImg2ImgPipeline",
            "inpaint": "StableDiffusionControlNetInpaintPipeline"},
    "sdxl": {"txt2img": "StableDiffusionXLControlNetPipeline", "img2img": "StableDiffusionXLControlNetImg2ImgPipeline",
             "inpaint": "StableDiffusionXLControlNetInpaintPipeline"},
}


def random_image(seed: int, height: int = SIZE, width: int = SIZE) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def mask_image() -> Image.Image:
    mask = np.zeros((SIZE, SIZE), dtype=np.uint8)
    mask[SIZE // 4: 3 * SIZE // 4, SIZE // 4: 3 * SIZE // 4] = 255
    return Image.fromarray(mask)


def task_inputs(task: str) -> dict:
    if task == "img2img":
        return {"image": random_image(10), "strength": 0.8}
    if task == "inpaint":
        return {"image": random_image(10), "mask_image": mask_image(), "strength": 0.9}
    return {}


def reference(pipe, controlnet, family: str, task: str):
    """diffusers' ControlNet pipeline of `task` on the torch modules."""
    ref = getattr(diffusers, DIFFUSERS[family][task])(**pipe.components, controlnet=controlnet)
    ref.set_progress_bar_config(disable=True)
    return ref


def run_diffusers(ref, task: str, control, prompts=2, steps=STEPS, **kwargs):
    control_argument = "image" if task == "txt2img" else "control_image"  # diffusers' names
    return ref(PROMPTS[:prompts], negative_prompt=NEGATIVE[:prompts], num_inference_steps=steps, guidance_scale=7.5,
               output_type="np", generator=torch.Generator().manual_seed(42), **{control_argument: control},
               **task_inputs(task), **kwargs).images


def run_kasoku(pipe, task: str, control, prompts=2, steps=STEPS, **kwargs):
    return pipe(PROMPTS[:prompts], negative_prompt=NEGATIVE[:prompts], num_inference_steps=steps, guidance_scale=7.5,
                output_type="np", generator=torch.Generator().manual_seed(42), control_image=control,
                **task_inputs(task), **kwargs).images


def pixel_difference(a: Image.Image, b: Image.Image) -> int:
    """The largest difference of two 8-bit images (engines loaded twice may round one pixel differently)."""
    return int(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max())


def assert_same_image(expected, actual):
    assert actual.shape == expected.shape
    assert psnr(expected, actual) >= MIN_PSNR
    assert np.abs(expected - actual).max() < MAX_ABS


# ---- fixtures: tiny ControlNets, compiled once per module -----------------------------------------


@pytest.fixture(scope="module")
def controlnet_dirs(tmp_path_factory):
    """Two tiny SD 1.x ControlNets (different weights) and one SDXL ControlNet, as `kasoku tiny --controlnet`
    writes them."""
    from kasoku.tools.tiny import write_tiny_controlnet

    root = tmp_path_factory.mktemp("controlnets")
    return {"sd1": [write_tiny_controlnet(root / f"sd1-{seed}", family="sd1", seed=seed) for seed in (0, 1)],
            "sdxl": [write_tiny_controlnet(root / "sdxl-0", family="sdxl", seed=0)]}


@pytest.fixture(scope="module")
def controlnet_dir(controlnet_dirs):
    return controlnet_dirs["sd1"][0]


@pytest.fixture(scope="module")
def controlnets(controlnet_dirs):
    from kasoku.model.loading import load_controlnets

    return {family: [load_controlnets(path) for path in paths] for family, paths in controlnet_dirs.items()}


@pytest.fixture(scope="module")
def pipes(tiny_dir, tmp_path_factory):
    """The tiny SD 1.x and SDXL pipelines loaded from their folders, as the folder-based tests (verify, bench,
    batch, generate) load them: their engines are the same cache entries."""
    from kasoku.model.loading import load_pipeline
    from kasoku.tools.tiny import write_tiny_pipeline

    sdxl = write_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny-sdxl", family="sdxl")
    return {"sd1": load_pipeline(tiny_dir), "sdxl": load_pipeline(sdxl)}


@pytest.fixture(scope="module")
def torch_multi(tiny_pipe, controlnets, tmp_path_factory):
    """Two ControlNets on the torch reference backend: no export, built in an instant."""
    return kasoku.compile(tiny_pipe, "torch", controlnet=controlnets["sd1"], cache_dir=tmp_path_factory.mktemp("c"))


@pytest.fixture(scope="module")
def sd_multi(pipes, controlnets, tiny_cache):
    return kasoku.compile(pipes["sd1"], "onnxruntime", controlnet=controlnets["sd1"], cache_dir=tiny_cache.root)


@pytest.fixture(scope="module")
def compiled(pipes, controlnets, tiny_cache, sd_multi):
    """One ControlNet per family on ONNX Runtime (SD 1.x's engines are those of `sd_multi`, from the cache)."""
    return {family: kasoku.compile(pipes[family], "onnxruntime", controlnet=controlnets[family][0],
                                   cache_dir=tiny_cache.root, label=f"{family}-controlnet") for family in pipes}


# ---- unit tier: specs, stand-ins on torch, checks --------------------------------------------------


def test_family_answers_the_controlnet_questions(tiny_pipe, controlnets):
    family = FAMILIES["sd1"]
    pipe = family.with_controlnet(tiny_pipe, controlnets["sd1"])
    assert type(pipe).__name__ == "StableDiffusionControlNetPipeline"
    assert Model.of(pipe).components == ("text_encoder", "controlnet_0", "controlnet_1", "unet_controlnet",
                                            "vae_decoder", "vae_encoder")
    assert Model.of(pipe).task_components("txt2img") == ("text_encoder", "controlnet_0", "controlnet_1",
                                                       "unet_controlnet", "vae_decoder")
    assert {task: type(family.task_pipeline(pipe, task)).__name__ for task in TASKS} == DIFFUSERS["sd1"]
    same_twice = family.with_controlnet(tiny_pipe, [controlnets["sd1"][0], controlnets["sd1"][0]])
    assert list(family.controlnet_components(same_twice)) == ["controlnet_0"]  # one engine per distinct model


def test_controlnet_specs_follow_the_image_size(tiny_pipe, controlnets):
    pipe = FAMILIES["sd1"].with_controlnet(tiny_pipe, controlnets["sd1"][0])
    specs = component_specs(pipe, names=["controlnet_0", "unet_controlnet"])
    controlnet, unet = specs["controlnet_0"], specs["unet_controlnet"]
    shapes = controlnet.profile_shapes()
    # tiny profile: 1..4 images of 32..128 px; the control image at pixel size, the latents at 1/8
    assert shapes["controlnet_cond"] == ((1, 3, 32, 32), (2, 3, 64, 64), (8, 3, 128, 128))
    assert shapes["sample"] == ((1, 4, 4, 4), (2, 4, 8, 8), (8, 4, 16, 16))
    residuals = controlnet_residuals(controlnets["sd1"][0].config)
    assert shapes["conditioning_scale"] == ((len(residuals),),) * 3  # one scale per residual
    assert controlnet.output_names == unet.input_names[3:]  # what the ControlNet makes, the U-Net takes
    with torch.no_grad():  # the residuals the spec describes are the ones diffusers' ControlNet makes
        down, mid = controlnets["sd1"][0](torch.randn(2, 4, 6, 10), 10, torch.randn(2, 77, 32),
                                          torch.rand(2, 3, 48, 80), return_dict=False)
    inputs = {"sample": (2, 4, 6, 10), "timestep": (2,), "encoder_hidden_states": (2, 77, 32),
              "controlnet_cond": (2, 3, 48, 80), "conditioning_scale": (len(residuals),)}
    assert list(controlnet.output_shapes(inputs).values()) == [tuple(t.shape) for t in (*down, mid)]


def test_tensorrt_profiles_cover_the_control_image_and_the_residuals(controlnets):
    from kasoku.backends.tensorrt import trt_profile

    pipe = FAMILIES["sdxl"].with_controlnet(FAMILIES["sdxl"].tiny_pipeline(), controlnets["sdxl"][0])
    specs = component_specs(pipe, names=["controlnet_0", "unet_controlnet"])
    controlnet, unet = trt_profile(specs["controlnet_0"]), trt_profile(specs["unet_controlnet"])
    assert controlnet["controlnet_cond"] == ((1, 3, 32, 32), (2, 3, 64, 64), (8, 3, 128, 128))
    assert controlnet["time_ids"] == unet["time_ids"] == ((1, 6), (2, 6), (8, 6))  # SDXL's added conditioning
    # the mid block's residual: 64 channels at 1/16 of the image (the tiny U-Net downsamples once)
    assert unet["mid_block_res"] == ((1, 64, 2, 2), (2, 64, 4, 4), (8, 64, 8, 8))


def test_guidance_profile_serves_guess_mode(tiny_pipe, controlnets):
    from dataclasses import replace

    from kasoku.core.components import ImageShape, ShapeProfile

    pipe = FAMILIES["sd1"].with_controlnet(tiny_pipe, controlnets["sd1"][0])
    exact = ShapeProfile.exact(ImageShape(1, 64, 64), guidance=True, multiple=16)
    specs = component_specs(pipe, exact, ["controlnet_0", "unet_controlnet"])
    assert specs["unet_controlnet"].profile_shapes()["sample"] == ((2, 4, 8, 8),) * 3
    # guess mode runs the ControlNet on the conditional half only: 1..2 images
    assert specs["controlnet_0"].profile_shapes()["sample"] == ((1, 4, 8, 8), (2, 4, 8, 8), (2, 4, 8, 8))
    assert specs["controlnet_0"].profile == replace(exact, guidance=None)


def test_export_derives_every_size_of_one_image_dim_from_one_dim(tiny_pipe, controlnets):
    from kasoku.core.components import torch_dynamic_shapes

    pipe = FAMILIES["sd1"].with_controlnet(tiny_pipe, controlnets["sd1"][0])
    specs = component_specs(pipe, names=["controlnet_0", "unet_controlnet"])
    shapes = torch_dynamic_shapes(specs["controlnet_0"])
    latent, pixel = shapes["sample"][2], shapes["controlnet_cond"][2]
    assert latent.root is pixel.root  # one Dim of the image height; the ControlNet's *added are bound too
    unet = torch_dynamic_shapes(specs["unet_controlnet"])
    assert set(unet) == {"sample", "timestep", "encoder_hidden_states", "rest"}  # the residuals: forward's *rest
    assert len(unet["rest"]) == len(specs["unet_controlnet"].input_names) - 3
    assert all(r[2].root is unet["sample"][2].root for r in unet["rest"])


def test_unfit_controlnets_are_refused(tiny_pipe, controlnets):
    with pytest.raises(UnfitControlNet, match="does not fit this Stable Diffusion 1.x model's U-Net: its "
                                              "cross_attention_dim, addition_embed_type"):
        FAMILIES["sd1"].with_controlnet(tiny_pipe, controlnets["sdxl"][0])
    pooled = FAMILIES["sd1"].tiny_controlnet(seed=0)
    pooled.register_to_config(global_pool_conditions=True)
    with pytest.raises(UnfitControlNet, match="global_pool_conditions"):
        FAMILIES["sd1"].with_controlnet(tiny_pipe, pooled)


def test_stand_ins_run_diffusers_multi_controlnet_pipeline_on_torch(tiny_pipe, controlnets, torch_multi):
    """The stand-ins and the scale vector, without export: the torch backend against diffusers."""
    control, kwargs = [random_image(1), random_image(2)], dict(controlnet_conditioning_scale=[0.5, 1.5], prompts=1,
                                                                   steps=2)
    expected = run_diffusers(reference(tiny_pipe, controlnets["sd1"], "sd1", "txt2img"), "txt2img", control, **kwargs)
    assert_same_image(expected, run_kasoku(torch_multi, "txt2img", control, **kwargs))


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "this pipeline runs 2 ControlNets: give `control_image` (a list of 2 images, one per ControlNet)"),
    (dict(control_image=random_image(1)), "`control_image` must be a list of 2 images, one per ControlNet for the "
                                          "2 ControlNets but is one image"),
    (dict(control_image=[random_image(1)] * 3), "`control_image` must be a list of 2 images, one per ControlNet but "
                                                "has 3"),
    (dict(control_image=[random_image(1), random_image(2, 48, 64)]),
     "`control_image` of ControlNet 2 is 48x64 (height x width) but the image is 64x64"),
    (dict(control_image=[[random_image(1), random_image(2)]] * 3),  # diffusers' per-prompt form, 3 for 1 prompt
     "`control_image` of ControlNet 1 must be one image or one per prompt (1) but is 3 images"),
    (dict(control_image=[[random_image(1)], [random_image(2), random_image(3)]]),
     "`control_image` as a list per prompt must give 2 images in each (one per ControlNet) but gives 1, 2"),
    (dict(controlnet_conditioning_scale=[1.0, 0.5, 0.2]),
     "`controlnet_conditioning_scale` gives 3 values for 2 ControlNets; give one number for all, or a list of 2"),
    (dict(controlnet_conditioning_scale=float("nan")), "`controlnet_conditioning_scale` must be a finite number"),
    (dict(control_guidance_start=[0.0, 0.8], control_guidance_end=[1.0, 0.5]),
     "must satisfy 0 <= start < end <= 1 but are 0.8 and 0.5"),
    (dict(guess_mode="yes"), "`guess_mode` must be True or False but is 'yes'"),
], ids=["missing", "one-for-two", "three-for-two", "wrong-size", "per-prompt-count", "nested-count", "scales",
        "nan-scale", "window", "guess-mode"])
def test_bad_control_inputs_fail_before_any_engine_runs(torch_multi, kwargs, message):
    inputs = {"control_image": [random_image(1), random_image(2)], **kwargs} if kwargs else {}
    torch_multi.times.reset()
    with pytest.raises(InvalidInput) as error:
        torch_multi("a cat", num_inference_steps=2, **inputs)
    assert message in str(error.value)
    assert not torch_multi.times.calls  # no engine ran


def test_control_arguments_need_a_controlnet(tiny_pipe, tmp_path):
    plain = kasoku.compile(tiny_pipe, "torch", cache_dir=tmp_path)
    for kwargs in (dict(control_image=random_image(1)), dict(guess_mode=True)):
        with pytest.raises(InvalidInput, match="this pipeline has no ControlNet; compile one with `controlnet=`"):
            plain("a cat", num_inference_steps=2, **kwargs)


def test_tiny_cli_writes_a_controlnet_beside_the_pipeline(tmp_path, capsys):
    from kasoku.model.fingerprint import module_fingerprint
    from kasoku.model.loading import load_controlnets

    assert main(["tiny", str(tmp_path / "sdxl"), "--family", "sdxl", "--controlnet", "--seed", "3"]) == 0
    assert "tiny ControlNet to" in capsys.readouterr().out
    written = load_controlnets(tmp_path / "sdxl" / "controlnet")
    assert type(written).__name__ == "ControlNetModel" and written.config.addition_embed_type == "text_time"
    assert module_fingerprint(written) == module_fingerprint(FAMILIES["sdxl"].tiny_controlnet(seed=3))
    assert module_fingerprint(written) != module_fingerprint(FAMILIES["sdxl"].tiny_controlnet(seed=4))
    # its output convolutions are not diffusers' zeros: the control image changes the image
    assert all(block.weight.abs().sum() > 0 for block in written.controlnet_down_blocks)


def test_batch_jobs_check_control_fields_before_work(tiny_dir, controlnet_dir, tmp_path):
    from kasoku.batch import InvalidJobs, prepare, read_jobs

    random_image(1).save(tmp_path / "edges.png")
    random_image(2, 32, 32).save(tmp_path / "small.png")
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(job) for job in [
        {"prompt": "a", "control_image": "missing.png"},
        {"prompt": "b", "control_image": 3},
        {"prompt": "c", "control_image": "edges.png", "control_scale": "high"},
    ]) + "\n")
    with pytest.raises(InvalidJobs) as error:
        read_jobs(tmp_path / "bad.jsonl")
    for words in ("`control_image` missing.png does not exist (paths are relative to the prompts file's folder)",
                  "`control_image` must be an image file or a list of them", "`control_scale` must be a number"):
        assert words in str(error.value)
    (tmp_path / "jobs.jsonl").write_text("\n".join(json.dumps(job) for job in [
        {"prompt": "a", "control_image": "edges.png", "control_scale": 0.5},
        {"prompt": "b", "control_image": ["edges.png", "edges.png"]},
        {"prompt": "c", "control_image": "small.png"},
        {"prompt": "d", "control_image": "edges.png", "control_scale": [1.0, 2.0]},
        {"prompt": "e"},
    ]) + "\n")
    jobs = read_jobs(tmp_path / "jobs.jsonl")
    assert jobs[0].control_image == (str(tmp_path / "edges.png"),) and jobs[0].control_scale == 0.5
    # a job without control fields keeps the key it had before they existed (earlier runs' results count)
    before = ("id", "prompt", "negative_prompt", "seed", "steps", "guidance", "height", "width")
    old_key = hashlib.sha256(json.dumps({name: getattr(jobs[4], name) for name in before},
                                        sort_keys=True).encode()).hexdigest()[:16]
    assert jobs[4].key == old_key and jobs[0].key != jobs[4].key
    with pytest.raises(InvalidJobs) as error:
        prepare(tiny_dir, jobs, tmp_path / "out", controlnet=[controlnet_dir], batch_size=2,
                cache_dir=tmp_path / "cache")
    message = str(error.value)
    for number, words in [(2, "`control_image` must give 1 control image, one per ControlNet, but gives 2"),
                          (3, f"`control_image` {tmp_path / 'small.png'} is 32x32 (height x width) but the job's "
                              "image is 64x64"),
                          (4, "`control_scale` gives 2 scales for 1 ControlNet;"),
                          (5, "`control_image` must give 1 control image")]:
        assert f"jobs.jsonl:{number}: {words}" in message
    assert not (tmp_path / "out").exists()  # nothing written
    with pytest.raises(InvalidJobs, match="`control_image` needs --controlnet"):
        prepare(tiny_dir, jobs[:1], tmp_path / "out", cache_dir=tmp_path / "cache")


# ---- integration tier: engines against diffusers ---------------------------------------------------


@integration
@pytest.mark.parametrize("family, task", [(f, t) for f in DIFFUSERS for t in TASKS])
def test_each_controlnet_pipeline_matches_diffusers(family, task, pipes, controlnets, compiled):
    pipe = pipes[family]
    control = random_image(1)
    expected = run_diffusers(reference(pipe, controlnets[family][0], family, task), task, control)
    compiled[family].times.reset()
    actual = run_kasoku(compiled[family], task, control)
    assert_same_image(expected, actual)
    assert compiled[family].times.calls["controlnet_0"] > 0 and compiled[family].times.calls["unet_controlnet"] > 0
    assert "unet" not in compiled[family].times.calls


@integration
def test_two_controlnets_with_different_scales(pipes, controlnets, sd_multi, compiled):
    control, kwargs = [random_image(1), random_image(2)], dict(controlnet_conditioning_scale=[0.4, 1.3])
    ref = reference(pipes["sd1"], controlnets["sd1"], "sd1", "txt2img")
    expected = run_diffusers(ref, "txt2img", control, **kwargs)
    actual = run_kasoku(sd_multi, "txt2img", control, **kwargs)
    assert_same_image(expected, actual)
    single = run_kasoku(compiled["sd1"], "txt2img", control[0], controlnet_conditioning_scale=0.4)
    assert psnr(single, actual) < 35  # the second ControlNet steers the image


@integration
def test_two_controlnets_of_one_architecture_share_one_graph(sd_multi):
    """Two SD 1.x ControlNets with their own weights (canny and depth, say): one export, an engine each."""
    stages = {(s.component, s.stage): s for s in sd_multi.compile_report.stages}
    assert stages[("controlnet_0", "export")].key == stages[("controlnet_1", "export")].key
    assert stages[("controlnet_1", "export")].status == "reused"
    assert stages[("controlnet_0", "engine")].key != stages[("controlnet_1", "engine")].key


@integration
def test_guess_mode(pipes, controlnets, compiled):
    control = random_image(1)
    expected = run_diffusers(reference(pipes["sd1"], controlnets["sd1"][0], "sd1", "txt2img"), "txt2img", control,
                             guess_mode=True, controlnet_conditioning_scale=0.8)
    actual = run_kasoku(compiled["sd1"], "txt2img", control, guess_mode=True, controlnet_conditioning_scale=0.8)
    assert_same_image(expected, actual)
    assert psnr(run_kasoku(compiled["sd1"], "txt2img", control, controlnet_conditioning_scale=0.8), actual) < 35


@integration
def test_control_guidance_window(pipes, controlnets, sd_multi):
    control = [random_image(1), random_image(2)]
    window = dict(control_guidance_start=[0.0, 0.4], control_guidance_end=[0.6, 1.0], num_inference_steps=5)
    expected = reference(pipes["sd1"], controlnets["sd1"], "sd1", "txt2img")(
        PROMPTS, negative_prompt=NEGATIVE, output_type="np", generator=torch.Generator().manual_seed(42),
        image=control, **window).images
    sd_multi.times.reset()
    actual = sd_multi(PROMPTS, negative_prompt=NEGATIVE, output_type="np", generator=torch.Generator().manual_seed(42),
                      control_image=control, **window).images
    assert_same_image(expected, actual)
    # outside its window a ControlNet's residuals are zeros: its engine is not called. diffusers keeps
    # ControlNet k at step i of n unless i/n < start_k or (i+1)/n > end_k (PNDM: 5 steps are 6 U-Net calls)
    n = len(sd_multi.scheduler.timesteps)
    assert sd_multi.times.calls["unet_controlnet"] == n == 6
    for k, (start, end) in enumerate(zip(window["control_guidance_start"], window["control_guidance_end"])):
        kept = sum(not (i / n < start or (i + 1) / n > end) for i in range(n))
        assert sd_multi.times.calls[f"controlnet_{k}"] == kept < n


@integration
def test_openvino_engines_match_too(pipes, controlnets, tiny_cache, sd_multi):
    # the ControlNet and its U-Net on OpenVINO; the rest (tested elsewhere on OpenVINO) on ONNX Runtime
    backends = {"text_encoder": "onnxruntime", "controlnet_0": "openvino", "unet_controlnet": "openvino",
                "vae_decoder": "onnxruntime"}
    compiled = kasoku.compile(pipes["sd1"], backends, controlnet=controlnets["sd1"][0], cache_dir=tiny_cache.root,
                              components=list(backends))
    assert {name: engine.backend for name, engine in compiled.engines.items()} == backends
    control = random_image(1)
    expected = run_diffusers(reference(pipes["sd1"], controlnets["sd1"][0], "sd1", "txt2img"), "txt2img", control)
    assert_same_image(expected, run_kasoku(compiled, "txt2img", control))


@integration
def test_from_pretrained_generate_and_verify_with_a_controlnet_folder(tiny_dir, controlnet_dir, tiny_cache, compiled,
                                                                      tmp_path, capsys):
    fast = kasoku.KasokuPipeline.from_pretrained(tiny_dir, "onnxruntime", controlnet=controlnet_dir,
                                                 cache_dir=tiny_cache.root)
    assert {s.status for s in fast.compile_report.stages} == {"reused"}  # same weights: the same engines
    random_image(1).save(tmp_path / "edges.png")
    out = tmp_path / "out.png"
    assert main(["generate", str(tiny_dir), "a cat", "--controlnet", str(controlnet_dir), "--control-image",
                 str(tmp_path / "edges.png"), "--control-scale", "0.6", "--steps", "2", "--backend", "onnxruntime",
                 "--cache-dir", str(tiny_cache.root), "-o", str(out)]) == 0
    assert "controlnet_0" in capsys.readouterr().out and Image.open(out).size == (SIZE, SIZE)
    expected = fast("a cat", control_image=random_image(1), controlnet_conditioning_scale=0.6, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0)).images[0]
    assert pixel_difference(Image.open(out), expected) <= 1
    report = kasoku.verify(tiny_dir, "onnxruntime", controlnet=[controlnet_dir], cache_dir=tiny_cache.root)
    assert report.passed, [c.line() for c in report.components if not c.passed]
    assert {"controlnet_0", "unet_controlnet"} <= {c.component for c in report.components}
    assert report.image.psnr_db >= MIN_PSNR


@integration
def test_bench_times_the_controlnet_and_its_unet(tiny_dir, controlnet_dir, tiny_cache, compiled):
    report = kasoku.bench(tiny_dir, ["onnxruntime"], controlnet=[controlnet_dir], steps=2, repeats=3,
                          components=["controlnet_0", "unet_controlnet"], cache_dir=tiny_cache.root)
    assert [c.component for c in report.components] == ["controlnet_0", "unet_controlnet"]
    for component in report.components:
        assert component.gflop > 0 and component.floor_s > 0
        assert component.results["onnxruntime"].max_abs_vs_torch < MAX_ABS
    assert all(r["max_abs_vs_diffusers"] < MAX_ABS for r in report.end_to_end.results.values())


@integration
def test_batch_jobs_with_control_images(tiny_dir, controlnet_dir, tiny_cache, compiled, tmp_path):
    from kasoku.batch import prepare, read_jobs, run_local

    random_image(1).save(tmp_path / "edges.png")
    random_image(2).save(tmp_path / "pose.png")
    # mixed guidance and the default size range: the engines of the default profile, from the cache
    (tmp_path / "jobs.jsonl").write_text("\n".join(json.dumps(job) for job in [
        {"prompt": "a cat", "control_image": "edges.png", "steps": 2, "seed": 1, "id": "cat"},
        {"prompt": "a dog", "control_image": "pose.png", "steps": 2, "seed": 2, "id": "dog"},
        {"prompt": "a bird", "control_image": "pose.png", "control_scale": 0.3, "steps": 2, "guidance": 1.0,
         "id": "bird"},
    ]) + "\n")
    plan = prepare(tiny_dir, read_jobs(tmp_path / "jobs.jsonl"), tmp_path / "out", controlnet=[controlnet_dir],
                   batch_size=2, backend="onnxruntime", cache_dir=tiny_cache.root, height=(32, 64, 128),
                   width=(32, 64, 128))
    result = run_local(plan)
    assert result.generated == 3 and sorted(p.name for p in (tmp_path / "out").glob("*.png")) == \
        ["bird.png", "cat.png", "dog.png"]
    expected = compiled["sd1"](["a cat", "a dog"], control_image=[random_image(1), random_image(2)],
                               num_inference_steps=2, generator=[torch.Generator().manual_seed(s) for s in (1, 2)]
                               ).images
    for name, image in zip(("cat", "dog"), expected):
        assert pixel_difference(Image.open(tmp_path / "out" / f"{name}.png"), image) <= 1


@integration
@pytest.mark.gpu
def test_tensorrt_engines_match_torch(tiny_pipe, controlnets, tmp_path):
    from kasoku.backends.tensorrt import TensorRTBackend
    from kasoku.core.components import ImageShape
    from kasoku.core.parity import compare_outputs
    from kasoku.model.loading import load_pipeline
    from kasoku.pipeline.compiling import compile_components

    availability = TensorRTBackend.availability()
    if not availability.available:
        pytest.skip(f"TensorRT unavailable: {availability.reason}")
    pipe = load_pipeline(tiny_pipe, controlnet=controlnets["sd1"])
    names = ["controlnet_0", "controlnet_1", "unet_controlnet"]
    engines, _ = compile_components(pipe, backend="tensorrt", components=names, cache=tmp_path)
    specs = component_specs(pipe, names=names)
    for name, engine in engines.items():
        for shape in (ImageShape(1, 64, 64), ImageShape(2, 32, 96)):
            inputs = specs[name].sample_inputs(shape, seed=5)
            results = compare_outputs(name, str(shape), specs[name].run_torch(inputs), engine.run(inputs))
            assert all(r.passed for r in results), [r.line() for r in results]


@pytest.mark.slow(reason="IP-Adapter and LoRA at once on ControlNet (each alone stays)")
@integration
def test_ip_adapter_with_lora_on_the_controlnet_pipeline(compiled, tiny_dir, controlnet_dir, tmp_path):
    """IP-Adapter, LoRA and a ControlNet at once (the U-Net that takes the residuals also takes the image prompt,
    and LoRA files' `unet` weights reach it): diffusers' image from the same generator."""
    from kasoku.tools.tiny import tiny_pipeline, write_tiny_ip_adapters
    from tests.runtime.test_ip_adapter import PLUS, image, picture, reference
    from tests.runtime.test_lora import ATTENTION, _save_unet_adapter

    lora = _save_unet_adapter(tmp_path / "lora", seed=1, rank=4, alpha=8, targets=ATTENTION)
    write_tiny_ip_adapters(tmp_path / "ip", tiny_pipeline().unet)
    ours = compiled["sd1"]
    ours.load_lora_weights(str(lora))
    ours.load_ip_adapter(str(tmp_path / "ip"), subfolder="", weight_name=PLUS)
    try:
        theirs = diffusers.StableDiffusionControlNetPipeline.from_pretrained(
            tiny_dir, controlnet=diffusers.ControlNetModel.from_pretrained(controlnet_dir), safety_checker=None)
        theirs.load_lora_weights(str(lora))
        reference(tmp_path, PLUS, folders=("ip",), pipe=theirs)
        expected = image(theirs, image=picture(4), ip_adapter_image=picture(1))
        assert psnr(expected, image(ours, control_image=picture(4), ip_adapter_image=picture(1))) >= MIN_PSNR
    finally:
        ours.unload_ip_adapter()
        ours.unload_lora_weights()


# ---- step caching with ControlNets: DeepCache's full graph takes the residuals, the shallow steps need none ---------

CACHED_STEPS = 7  # the tiny scheduler (PNDM) makes 8 denoiser calls of it
CALLS = 8


@pytest.fixture(scope="module")
def deepcached(pipes, controlnets, tiny_cache, sd_multi):
    """Two ControlNets with DeepCache's graphs (the plain engines are sd_multi's, from the cache)."""
    return kasoku.compile(pipes["sd1"], "onnxruntime", controlnet=controlnets["sd1"], cache_dir=tiny_cache.root,
                          step_cache=True)


@integration
def test_deepcache_full_graph_adds_the_residuals_as_diffusers_does(deepcached):
    from kasoku.core.step_cache import StepCacheRun

    control = [random_image(1), random_image(2)]
    plain = run_kasoku(deepcached, "txt2img", control, steps=CACHED_STEPS)
    deepcached.times.reset()
    # every step through unet_full (interval 1): the same image as unet_controlnet's
    with deepcached._runtime._step_cache_target.step_cache(StepCacheRun(1, "uniform", lambda: CALLS)):
        every = run_kasoku(deepcached, "txt2img", control, steps=CACHED_STEPS)
    assert deepcached.times.calls["unet_full"] == CALLS and "unet_controlnet" not in deepcached.times.calls
    assert_same_image(plain, every)


@integration
def test_deepcache_with_controlnets_runs_them_on_full_steps_only(deepcached):
    from kasoku.core.step_cache import full_steps

    control = [random_image(1), random_image(2)]
    plain = run_kasoku(deepcached, "txt2img", control, steps=CACHED_STEPS)
    deepcached.times.reset()
    cached = run_kasoku(deepcached, "txt2img", control, steps=CACHED_STEPS, cache_interval=3)
    calls = deepcached.times.calls
    full = len(full_steps(CALLS, 3, "uniform"))
    assert (calls["unet_full"], calls["unet_shallow"]) == (full, CALLS - full)
    assert calls["controlnet_0"] == calls["controlnet_1"] == full  # a shallow step reads no residuals
    assert 25.0 <= psnr(plain, cached) < 80.0  # DeepCache's drift: bounded, and not nothing
    weaker = run_kasoku(deepcached, "txt2img", control, steps=CACHED_STEPS, cache_interval=3,
                        controlnet_conditioning_scale=0.2)
    assert psnr(cached, weaker) < 40  # the residuals of the full steps still steer the image
