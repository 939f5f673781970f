"""The pipeline object is diffusers': what diffusers code reads and calls on a pipeline besides `__call__` works on
a KasokuPipeline as it does in diffusers (SD 1.x, SDXL and Flux), on the engines: `components`, `config`, `dtype`,
`device`, the component attributes, `to`, `progress_bar` and its configuration, the memory-saving switches (accepted
with a note), `save_pretrained`, diffusers' `from_pipe` of another task, and the per-call LoRA scale."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from diffusers import (
    FluxImg2ImgPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLImg2ImgPipeline,
)
from PIL import Image

import kasoku
from kasoku.core.components import ShapeProfile
from kasoku.core.parity import psnr
from kasoku.pipeline.kasoku_pipeline import InvalidInput
from kasoku.pipeline.surface import ENGINES_NOTE_FILE, MEMORY_SWITCHES, EngineNote
from kasoku.tools.tiny import tiny_pipeline

pytestmark = pytest.mark.integration  # builds engines

MIN_PSNR = 40.0
# family -> (its denoiser's attribute, diffusers' image-to-image class)
FAMILIES = {"sd1": ("unet", StableDiffusionImg2ImgPipeline), "sdxl": ("unet", StableDiffusionXLImg2ImgPipeline),
            "flux": ("transformer", FluxImg2ImgPipeline)}


@pytest.fixture(scope="module")
def pipes(tiny_pipe):
    pipes = {"sd1": tiny_pipe, "sdxl": tiny_pipeline(family="sdxl"), "flux": tiny_pipeline(family="flux")}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return pipes


@pytest.fixture(scope="module")
def compiled(pipes, tiny_cache, tiny_compiled, tmp_path_factory):
    """SD 1.x on ONNX Runtime engines from the session cache; SDXL and Flux on the torch reference backend (no
    export: the surface is the same whatever runs the components), 64x64 to 128x128."""
    profile = ShapeProfile.from_ranges((1, 1, 2), (64, 64, 128), (64, 64, 128), 16)
    root = tmp_path_factory.mktemp("surface")
    return {"sd1": kasoku.compile(pipes["sd1"], "onnxruntime", cache_dir=tiny_cache.root),
            **{name: kasoku.compile(pipes[name], "torch", profile=profile, cache_dir=root)
               for name in ("sdxl", "flux")}}


def run(pipe, seed=0, **call):
    return pipe("a photo of a cat", generator=torch.Generator().manual_seed(seed), num_inference_steps=2,
                output_type="np", height=64, width=64, **call).images


@pytest.mark.parametrize("family", FAMILIES)
def test_the_object_reads_as_a_diffusers_pipeline(family, pipes, compiled):
    pipe, fast = pipes[family], compiled[family]
    denoiser = FAMILIES[family][0]
    assert set(fast.components) == set(pipe.components)
    assert fast.components[denoiser] is getattr(fast, denoiser)
    assert getattr(fast, denoiser).config == getattr(pipe, denoiser).config  # the stand-in carries its config
    assert fast.text_encoder.config.to_dict() == pipe.text_encoder.config.to_dict()
    assert fast.tokenizer("a cat").input_ids == pipe.tokenizer("a cat").input_ids
    assert fast.scheduler.config == pipe.scheduler.config
    assert {k for k in pipe.config if not k.startswith("_")} <= set(fast.config)
    assert fast.dtype == torch.float32 and fast.device == torch.device("cpu")
    assert fast.to("cpu") is fast and fast.to(torch.device("cpu"), torch.float32) is fast
    with pytest.raises(InvalidInput, match=r"these engines take and give torch.float32 tensors.*precision='bf16'"):
        fast.to(torch.float16)
    with pytest.raises(InvalidInput, match=r"these engines run on cpu: `to\('cuda'\)` needs engines built for cuda"):
        fast.to("cuda")
    with pytest.raises(AttributeError, match="`load_textual_inversion` is diffusers'.*before kasoku.compile"):
        getattr(fast, "load_textual_inversion")  # noqa: B009
    with pytest.raises(AttributeError, match="no attribute 'not_a_thing'"):
        getattr(fast, "not_a_thing")  # noqa: B009


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pipe_gives_the_other_task_on_the_same_engines(family, pipes, compiled):
    denoiser, img2img_class = FAMILIES[family]
    fast = compiled[family]
    ours = img2img_class.from_pipe(fast)
    assert type(ours) is img2img_class and getattr(ours, denoiser) is getattr(fast, denoiser)
    theirs = img2img_class.from_pipe(pipes[family])
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    call = dict(image=image, strength=0.7, **({"height": 64, "width": 64} if family == "flux" else {}))
    fast.times.reset()
    expected = theirs("a photo of a cat", generator=torch.Generator().manual_seed(0), num_inference_steps=2,
                      output_type="np", **call).images
    actual = ours("a photo of a cat", generator=torch.Generator().manual_seed(0), num_inference_steps=2,
                  output_type="np", **call).images
    assert fast.times.calls[denoiser]  # the engines ran it
    assert psnr(expected, actual) >= MIN_PSNR


def test_progress_bars_follow_diffusers_configuration(compiled, capsys):
    fast = compiled["sd1"]
    try:
        fast.set_progress_bar_config(disable=False)
        bar = fast.progress_bar(total=3)
        assert not bar.disable and bar.total == 3
        bar.close()
        run(fast)
        assert "2/2" in capsys.readouterr().err  # diffusers' own bar over the steps
        fast.set_progress_bar_config(disable=True)
        assert fast.progress_bar(total=3).disable and not fast.shows_progress
        run(fast)
        assert "2/2" not in capsys.readouterr().err
    finally:
        fast.set_progress_bar_config(disable=True)


def test_memory_switches_are_accepted_with_what_they_mean_for_engines(compiled):
    fast = compiled["sd1"]
    before = run(fast)
    for switch in MEMORY_SWITCHES:
        with pytest.warns(EngineNote, match=rf"^{switch}: "):
            getattr(fast, switch)()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast.enable_attention_slicing()  # said once per pipeline
        fast.disable_attention_slicing()
        fast.disable_vae_tiling()
        fast.unfuse_qkv_projections()
    assert not [w for w in caught if issubclass(w.category, EngineNote)]
    assert np.array_equal(before, run(fast))  # the engines are what they were
    with pytest.raises(InvalidInput, match="FreeU changes what the U-Net computes"):
        fast.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)


def test_save_pretrained_writes_the_weights_and_where_the_engines_are(tiny_dir, tiny_pipe, tiny_cache, tiny_compiled,
                                                                      tmp_path):
    lazy = kasoku.KasokuPipeline.from_pretrained(tiny_dir, backend="onnxruntime", cache_dir=tiny_cache.root)
    lazy.save_pretrained(tmp_path / "saved")
    assert all(p.is_meta for p in lazy.model.pipe.unet.parameters())  # read for the save, and dropped again
    saved = StableDiffusionPipeline.from_pretrained(tmp_path / "saved")
    saved.set_progress_bar_config(disable=True)
    assert np.array_equal(run(saved), run(tiny_pipe))
    note = json.loads((tmp_path / "saved" / ENGINES_NOTE_FILE).read_text())
    assert note["engines"] == str(tiny_cache.root) and note["backends"]["unet"] == "onnxruntime"
    again = kasoku.KasokuPipeline.from_pretrained(tmp_path / "saved", backend="onnxruntime", cache_dir=note["engines"])
    assert {s.status for s in again.compile_report.stages} == {"reused"}  # the same weights: the same engines


def test_the_lora_scale_of_a_call_is_diffusers(tiny_cache, tiny_compiled, tmp_path):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    maker = tiny_pipeline()
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                        init_lora_weights=False)
    maker.unet.add_adapter(config)
    StableDiffusionPipeline.save_lora_weights(tmp_path, unet_lora_layers=get_peft_model_state_dict(maker.unet),
                                              unet_lora_adapter_metadata=config.to_dict())
    reference = tiny_pipeline()
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(str(tmp_path), adapter_name="a")
    fast = kasoku.compile(tiny_pipeline(), "onnxruntime", cache_dir=tiny_cache.root)
    fast.set_progress_bar_config(disable=True)
    fast.load_lora_weights(str(tmp_path), adapter_name="a")
    half = {"cross_attention_kwargs": {"scale": 0.5}}
    assert psnr(run(reference, **half), run(fast, **half)) >= MIN_PSNR
    assert psnr(run(reference), run(fast)) >= MIN_PSNR  # the next call without it: the whole adapter again
    assert psnr(run(fast), run(fast, **half)) < MIN_PSNR  # the scale changes the image
