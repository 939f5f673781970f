"""KasokuPipeline gives diffusers' image: same seed, same scheduler, same steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
)
from PIL import Image

import kasoku
from kasoku.core.components import Precision, ShapeOutOfProfile
from kasoku.core.parity import TOLERANCES, psnr
from kasoku.pipeline.kasoku_pipeline import InvalidInput

MIN_PSNR = TOLERANCES[Precision.FP32].image_psnr_db
SCHEDULERS = {"ddim": DDIMScheduler, "euler-ancestral": EulerAncestralDiscreteScheduler,
              "dpm++": DPMSolverMultistepScheduler}
PROMPTS = ["a photo of an astronaut riding a horse", "a watercolor painting of a cat"]
NEGATIVE = ["blurry", "ugly"]


def init_image(size=64, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def mask_image(size=64):
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    return Image.fromarray(mask)


def reference(pipe, task):
    cls = {"txt2img": StableDiffusionPipeline, "img2img": StableDiffusionImg2ImgPipeline,
           "inpaint": StableDiffusionInpaintPipeline}[task]
    ref = cls(**pipe.components)
    ref.set_progress_bar_config(disable=True)
    return ref


def task_kwargs(task):
    if task == "img2img":
        return {"image": init_image(), "strength": 0.7}
    if task == "inpaint":
        return {"image": init_image(), "mask_image": mask_image(), "strength": 0.9}
    return {}


def generate(pipe, task, scheduler, guidance, **extra):
    pipe.scheduler = SCHEDULERS[scheduler].from_config(pipe.scheduler.config)
    return pipe(PROMPTS, negative_prompt=NEGATIVE if guidance > 1 else None, num_inference_steps=3,
                guidance_scale=guidance, num_images_per_prompt=2, generator=torch.Generator().manual_seed(42),
                output_type="np", **task_kwargs(task), **extra).images


@pytest.mark.parametrize("guidance", [1.0, 7.5], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("task", ["txt2img", "img2img"])
def test_same_image_as_diffusers(tiny_pipe, tiny_kasoku, task, scheduler, guidance):
    expected = generate(reference(tiny_pipe, task), task, scheduler, guidance)
    actual = generate(tiny_kasoku, task, scheduler, guidance)
    assert actual.shape == expected.shape == (4, 64, 64, 3)
    assert psnr(expected, actual) >= MIN_PSNR
    assert np.abs(expected - actual).max() < 1e-3


@pytest.mark.parametrize("guidance", [1.0, 7.5], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("variant", ["9-channel", "4-channel"])
def test_inpaint_same_image_as_diffusers(tiny_pipe, tiny_kasoku, tiny_inpaint_pipe, tiny_inpaint_kasoku,
                                         variant, scheduler, guidance):
    torch_pipe, engine_pipe = ((tiny_inpaint_pipe, tiny_inpaint_kasoku) if variant == "9-channel"
                               else (tiny_pipe, tiny_kasoku))
    expected = generate(reference(torch_pipe, "inpaint"), "inpaint", scheduler, guidance)
    actual = generate(engine_pipe, "inpaint", scheduler, guidance)
    assert psnr(expected, actual) >= MIN_PSNR


@pytest.mark.parametrize("output_type", ["latent", "np"])
def test_output_types_match_diffusers(tiny_pipe, tiny_kasoku, output_type):
    kwargs = dict(num_inference_steps=2, generator=torch.Generator().manual_seed(1), output_type=output_type)
    tiny_kasoku.scheduler = PNDMScheduler.from_config(tiny_kasoku.scheduler.config)
    expected = reference(tiny_pipe, "txt2img")("a red car", **kwargs).images
    kwargs["generator"] = torch.Generator().manual_seed(1)
    actual = tiny_kasoku("a red car", **kwargs).images
    assert type(actual) is type(expected)
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=1e-4)
    if output_type == "latent":
        assert tuple(actual.shape) == (1, 4, 8, 8)


def test_pil_output_and_return_dict(tiny_kasoku):
    out = tiny_kasoku("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    assert isinstance(out.images[0], Image.Image) and out.images[0].size == (64, 64)
    images, nsfw = tiny_kasoku("a cat", num_inference_steps=2, return_dict=False)
    assert len(images) == 1 and nsfw is None


def test_callback_runs_every_step(tiny_kasoku):
    steps = []

    def on_step(pipe, step, timestep, kwargs):
        steps.append(step)
        return kwargs

    tiny_kasoku.scheduler = DDIMScheduler.from_config(tiny_kasoku.scheduler.config)
    tiny_kasoku("a dog", num_inference_steps=3, callback_on_step_end=on_step)
    assert steps == [0, 1, 2]


def test_xformers_pipeline_compiles_to_the_same_image(tiny_pipe, tiny_kasoku, tiny_cache):
    from diffusers.models.attention_processor import XFormersAttnProcessor

    from kasoku.tools.tiny import tiny_pipeline

    xformers_pipe = tiny_pipeline()
    xformers_pipe.unet.set_attn_processor(XFormersAttnProcessor())
    xformers_pipe.vae.set_attn_processor(XFormersAttnProcessor())
    compiled = kasoku.compile(xformers_pipe, backend="onnxruntime", cache_dir=tiny_cache.root)
    assert all(isinstance(p, XFormersAttnProcessor) for p in xformers_pipe.unet.attn_processors.values())
    kwargs = dict(num_inference_steps=3, output_type="np")
    for pipe in (tiny_kasoku, compiled):
        pipe.scheduler = DDIMScheduler.from_config(tiny_pipe.scheduler.config)
    plain = tiny_kasoku("a photo of a horse", generator=torch.Generator().manual_seed(3), **kwargs).images
    accelerated = compiled("a photo of a horse", generator=torch.Generator().manual_seed(3), **kwargs).images
    assert psnr(plain, accelerated) >= MIN_PSNR


def test_openvino_pipeline_matches_too(tiny_pipe, tiny_cache, tiny_compiled):
    compiled = kasoku.compile(tiny_pipe, backend="openvino", cache_dir=tiny_cache.root)
    compiled.scheduler = DDIMScheduler.from_config(tiny_pipe.scheduler.config)
    expected = generate(reference(tiny_pipe, "txt2img"), "txt2img", "ddim", 7.5)
    assert psnr(expected, generate(compiled, "txt2img", "ddim", 7.5)) >= MIN_PSNR


@pytest.fixture(scope="module")
def strict_kasoku(tiny_pipe, tiny_cache, tiny_compiled):
    """The tiny engines (from the cache) under `strict_shapes=True`: a call outside the profile is refused."""
    return kasoku.compile(tiny_pipe, backend="onnxruntime", cache_dir=tiny_cache.root, strict_shapes=True)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(prompt="a cat", height=100, width=64), InvalidInput,
         r"`height` and `width` must be multiples of 16 for this model.s engines .* but are 100 and 64"),
        (dict(prompt="a cat", height=256, width=64), ShapeOutOfProfile,
         r"height=256 is outside the compiled profile \(height 32\.\.128\)\. Compile a wider profile, e\.g\. "
         r"`kasoku\.compile\(pipe, profile=ShapeProfile\.from_ranges\(batch=\(1, 1, 4\), height=\(32, 64, 256\), "
         r"width=\(32, 64, 128\), multiple=16\)\)`, or leave out `profile=` and `strict_shapes=True`"),
        (dict(prompt=["a"] * 3, num_images_per_prompt=2), ShapeOutOfProfile, r"batch=6 .*batch 1\.\.4"),
        (dict(prompt=[]), InvalidInput, "`prompt` is an empty list"),
        (dict(prompt="a cat", image=init_image(), strength=1.5), InvalidInput, r"`strength` must be in \[0, 1\]"),
        (dict(prompt="a cat", image=init_image(64), mask_image=mask_image(32)), InvalidInput,
         r"same size but are \(64, 64\) and \(32, 32\)"),
    ],
    ids=["not-divisible", "outside-profile", "batch-too-large", "empty-prompts", "strength", "mask-size"],
)
def test_bad_input_fails_before_any_engine_runs(strict_kasoku, kwargs, error, message):
    strict_kasoku.times.reset()
    with pytest.raises(error, match=message):
        strict_kasoku(**kwargs)
    assert not strict_kasoku.times.calls  # no engine ran


def test_inpainting_model_needs_a_mask(tiny_inpaint_kasoku):
    with pytest.raises(InvalidInput, match="inpainting model"):
        tiny_inpaint_kasoku("a cat", num_inference_steps=2)


def test_from_pretrained_and_scheduler_by_name(tiny_dir, tiny_cache, tiny_compiled):
    pipe = kasoku.KasokuPipeline.from_pretrained(tiny_dir, backend="onnxruntime", cache_dir=tiny_cache.root)
    assert {s.status for s in pipe.compile_report.stages} == {"reused"}
    pipe.set_scheduler("euler")
    assert type(pipe.scheduler).__name__ == "EulerDiscreteScheduler"
    with pytest.raises(InvalidInput, match="unknown scheduler 'magic'; choose from ddim, pndm"):
        pipe.set_scheduler("magic")
    assert pipe("a cat", num_inference_steps=2, output_type="np").images.shape == (1, 64, 64, 3)
