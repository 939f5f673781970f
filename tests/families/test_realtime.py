"""Real-time images on a CPU: the tiny autoencoder (TAESD) as the VAE, LCM-distilled U-Nets, the few-step
schedulers by name, and guidance-free engines, on the tiny families against diffusers' own pipelines."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import kasoku
from kasoku.core.components import Precision
from kasoku.core.parity import TOLERANCES, psnr
from kasoku.pipeline.kasoku_pipeline import InvalidInput
from kasoku.tools.tiny import tiny_pipeline

pytestmark = pytest.mark.integration  # builds engines

MIN_PSNR = TOLERANCES[Precision.FP32].image_psnr_db
FP32_BOUND = TOLERANCES[Precision.FP32]


def run(pipe, seed=0, **kwargs):
    call = dict(num_inference_steps=2, generator=torch.Generator().manual_seed(seed), output_type="np")
    return pipe("a photo of a cat", **{**call, **kwargs}).images


def picture(size=64, seed=3):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


# ---- the tiny autoencoder ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def taesd_pipes(tiny_cache):
    """{family: (diffusers pipeline on a tiny AutoencoderTiny, its KasokuPipeline on ONNX Runtime)}: TAESD's
    layout for SD 1.x (4 latent channels), TAESD3's for SD3 (16). The session cache serves the engines other
    tests built for the same tiny models (only the tiny VAEs are new)."""
    from kasoku.families import FAMILIES
    from kasoku.model.loading import with_tiny_vae

    pipes = {}
    for family in ("sd1", "sd3"):
        reference = with_tiny_vae(tiny_pipeline(family=family), FAMILIES[family].tiny_vae())
        pipes[family] = reference, kasoku.compile(reference, "onnxruntime", cache_dir=tiny_cache.root)
    return pipes


@pytest.mark.parametrize("family", ["sd1", "sd3"])
def test_tiny_vae_decodes_and_encodes_as_diffusers_autoencoder_tiny(family, taesd_pipes):
    reference, fast = taesd_pipes[family]
    tiny = reference.vae
    channels = tiny.config.latent_channels
    latents = torch.randn(2, channels, 8, 8, generator=torch.Generator().manual_seed(1))
    image = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        decoded, encoded = tiny.decode(latents).sample, tiny.encode(image).latents
    engines = fast.engines
    got_decoded = engines["vae_decoder"].run({"latent_sample": latents})["sample"]
    got_encoded = engines["vae_encoder"].run({"sample": image})["latents"]
    for got, expected in ((got_decoded, decoded), (got_encoded, encoded)):  # the fp32 contract's bound
        bound = FP32_BOUND.rel_to_peak * max(1.0, float(expected.abs().max()))
        assert float((got - expected).abs().max()) <= bound
    assert fast.engines["vae_encoder"].spec.output_names == ("latents",)  # the latents: no distribution


@pytest.mark.parametrize("family", ["sd1", "sd3"])
def test_a_pipeline_on_the_tiny_vae_gives_diffusers_images_in_every_task(family, taesd_pipes):
    reference, fast = taesd_pipes[family]
    from kasoku.model.pipeline_model import Model

    assert psnr(run(reference), run(fast)) >= MIN_PSNR

    img2img = Model.of(reference).task_pipeline("img2img")
    call = dict(image=picture(), strength=0.6, num_inference_steps=3)
    assert psnr(run(img2img, **call), run(fast, **call)) >= MIN_PSNR


def test_tiny_vae_swap_from_a_folder_says_the_images_differ(tiny_dir, tiny_cache, taesd_pipes, tmp_path):
    from kasoku.tools.tiny import write_tiny_vae

    folder = write_tiny_vae(tmp_path / "taesd")  # the sd1 fixture's tiny VAE: its engines come from the cache
    fast = kasoku.KasokuPipeline.from_pretrained(str(tiny_dir), "onnxruntime", tiny_vae=folder,
                                                 cache_dir=tiny_cache.root, components=("text_encoder", "unet",
                                                                                           "vae_decoder"))
    assert type(fast.model.pipe.vae).__name__ == "AutoencoderTiny"
    assert any("tiny autoencoder" in note for note in fast.compile_report.notes)
    wrong = write_tiny_vae(tmp_path / "taesd3", family="sd3")
    with pytest.raises(kasoku.KasokuError, match="the tiny VAE has 16 latent channels but this pipeline's VAE has 4"):
        kasoku.KasokuPipeline.from_pretrained(str(tiny_dir), "onnxruntime", tiny_vae=wrong, cache_dir=tmp_path)


# ---- LCM-distilled U-Nets and few-step schedulers ------------------------------------------------------


@pytest.fixture(scope="module")
def lcm(tmp_path_factory):
    """The tiny LCM pipeline (LatentConsistencyModelPipeline, an LCM-distilled U-Net) and its KasokuPipeline."""
    reference = tiny_pipeline(lcm=True)
    fast = kasoku.compile(reference, "onnxruntime", cache_dir=tmp_path_factory.mktemp("cache"))
    return reference, fast


def test_an_lcm_pipeline_gives_diffusers_images_with_the_guidance_embedded(lcm):
    reference, fast = lcm
    assert type(reference).__name__ == "LatentConsistencyModelPipeline"
    assert "timestep_cond" in fast.engines["unet"].spec.input_names
    images = {guidance: (run(reference, num_inference_steps=4, guidance_scale=guidance),
                         run(fast, num_inference_steps=4, guidance_scale=guidance)) for guidance in (8.0, 1.5)}
    for expected, got in images.values():
        assert psnr(expected, got) >= MIN_PSNR
    # the embedding changes the image (the engine reads it): by far more than the engine differs from torch
    effect = np.abs(images[8.0][0] - images[1.5][0]).max()
    assert effect > 10 * max(np.abs(expected - got).max() for expected, got in images.values())
    assert np.abs(images[8.0][1] - images[1.5][1]).max() > effect / 2
    from kasoku.model.pipeline_model import Model

    img2img = Model.of(reference).task_pipeline("img2img")
    assert type(img2img).__name__ == "LatentConsistencyModelImg2ImgPipeline"
    call = dict(image=picture(), strength=0.5, num_inference_steps=4)
    assert psnr(run(img2img, **call), run(fast, **call)) >= MIN_PSNR


def test_lcm_calls_run_one_denoiser_row_per_image(lcm, monkeypatch):
    """No classifier-free guidance with an LCM U-Net: the engine sees the images' batch, not twice it."""
    _, fast = lcm
    shapes = []
    engine = fast.engines["unet"]
    original = engine.run
    monkeypatch.setattr(engine, "run", lambda inputs: shapes.append(tuple(inputs["sample"].shape)) or original(inputs))
    run(fast, num_inference_steps=2, guidance_scale=8.0, num_images_per_prompt=2)
    assert shapes and {shape[0] for shape in shapes} == {2}


def test_lcm_refuses_more_steps_than_it_was_distilled_on(lcm):
    _, fast = lcm
    with pytest.raises(InvalidInput, match="must be at most 50 for this scheduler"):
        run(fast, num_inference_steps=60)
    with pytest.raises(InvalidInput, match="must be at most 25 at `strength` 0.5 for LCMScheduler"):
        run(fast, image=picture(), strength=0.5, num_inference_steps=30)
    with pytest.raises(InvalidInput, match="`negative_prompt` does not apply to txt2img "
                                      r"\(LatentConsistencyModelPipeline"):
        run(fast, negative_prompt="blurry")


@pytest.mark.slow(reason="SDXL's LCM U-Net (SD 1.x's LCM pipeline stays)")
def test_sdxl_runs_an_lcm_unet_in_its_own_pipeline(tiny_cache):
    reference = tiny_pipeline(family="sdxl", lcm=True)
    assert type(reference).__name__ == "StableDiffusionXLPipeline"
    # the session cache: the tiny SDXL's text encoders and VAE are the same weights wherever they were built
    fast = kasoku.compile(reference, "onnxruntime", cache_dir=tiny_cache.root,
                          components=("text_encoder", "text_encoder_2", "unet", "vae_decoder"))
    assert psnr(run(reference, num_inference_steps=4, guidance_scale=6.0),
                run(fast, num_inference_steps=4, guidance_scale=6.0)) >= MIN_PSNR


@pytest.mark.parametrize("name, steps, guidance", [("euler-trailing", 1, 0.0), ("euler-ancestral-trailing", 1, 0.0),
                                                    ("tcd", 4, 0.0), ("lcm", 4, 1.0)])
def test_few_step_schedulers_by_name_give_diffusers_images_without_guidance(name, steps, guidance, tiny_kasoku,
                                                                           tiny_pipe):
    """SD-Turbo's 1 step at guidance 0 (trailing Euler), TCD's and LCM-LoRA's 4: one U-Net row per image."""
    from kasoku.core.schedulers import few_step_defaults, scheduler_named
    from kasoku.model.pipeline_model import Model

    scheduler = scheduler_named(name, tiny_pipe.scheduler)
    assert few_step_defaults(scheduler) == (steps, guidance)
    reference = Model.of(tiny_pipe).task_pipeline("txt2img", scheduler=scheduler)
    previous = tiny_kasoku.scheduler
    tiny_kasoku.set_scheduler(name)
    try:
        assert type(tiny_kasoku.scheduler) is type(scheduler)
        tiny_kasoku.times.reset()
        got = run(tiny_kasoku, num_inference_steps=steps, guidance_scale=guidance)
        assert tiny_kasoku.times.calls["unet"] == steps
        assert psnr(run(reference, num_inference_steps=steps, guidance_scale=guidance), got) >= MIN_PSNR
    finally:
        tiny_kasoku.scheduler = previous


def test_generate_with_a_few_step_scheduler_defaults_to_its_steps_and_builds_batch_one_engines(tiny_dir, tmp_path,
                                                                                             capsys):
    from kasoku.cli import main

    cache = tmp_path / "cache"
    assert main(["generate", str(tiny_dir), "a cat", "-o", str(tmp_path / "turbo.png"), "--scheduler",
                 "euler-trailing", "--backend", "onnxruntime", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    # one U-Net step, SD-Turbo's documented setting
    assert any("unet " in line and " 1 calls" in line for line in out.splitlines()), out
    (unet,) = [e for e in kasoku.Cache(cache).list() if e.kind == "engine" and e.component == "unet"]
    profile = unet.parts["profile"]
    # guidance 0: exact-shape engines for one image without classifier-free guidance (one U-Net row)
    assert profile["max"]["batch"] == 1 and profile["guidance"] is False


def test_tiny_writes_an_lcm_pipeline_and_a_tiny_vae(tmp_path):
    from diffusers import AutoencoderTiny, LatentConsistencyModelPipeline

    from kasoku.cli import main

    assert main(["tiny", str(tmp_path / "lcm"), "--lcm", "--tiny-vae"]) == 0
    pipe = LatentConsistencyModelPipeline.from_pretrained(tmp_path / "lcm")
    assert pipe.unet.config.time_cond_proj_dim and type(pipe.scheduler).__name__ == "LCMScheduler"
    assert AutoencoderTiny.from_pretrained(tmp_path / "lcm" / "tiny_vae").config.latent_channels == 4


@pytest.mark.parametrize("scheduler, steps, guidance, seed", [("lcm", 4, 1.0, 11), ("tcd", 4, 0.0, 12),
                                                               ("euler-trailing", 1, 0.0, 13)],
                         ids=["lcm-lora", "tcd-lora", "hyper-sd-lora"])
def test_few_step_loras_run_through_the_lora_path(scheduler, steps, guidance, seed, tiny_kasoku, tmp_path):
    """LCM-LoRA, TCD's and Hyper-SD's LoRAs are LoRA files plus their scheduler: loaded on the compiled pipeline as
    diffusers loads them, the few-step images match diffusers'."""
    from kasoku.core.schedulers import scheduler_named
    from tests.runtime.test_lora import ATTENTION, _save_unet_adapter

    adapter = _save_unet_adapter(tmp_path / scheduler, seed=seed, rank=4, alpha=8, targets=ATTENTION)
    reference = tiny_pipeline()  # its own modules: diffusers' LoRA loading changes them
    reference.scheduler = scheduler_named(scheduler, reference.scheduler)
    reference.load_lora_weights(str(adapter), adapter_name="speed")
    previous = tiny_kasoku.scheduler
    try:
        tiny_kasoku.load_lora_weights(str(adapter), adapter_name="speed")
        tiny_kasoku.set_scheduler(scheduler)
        call = dict(num_inference_steps=steps, guidance_scale=guidance)
        assert psnr(run(reference, **call), run(tiny_kasoku, **call)) >= MIN_PSNR
    finally:
        tiny_kasoku.unload_lora_weights()
        tiny_kasoku.scheduler = previous
        reference.unload_lora_weights()
