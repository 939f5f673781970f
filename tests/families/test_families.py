"""SD 2.x and SDXL through the whole flow: tiny folders diffusers loads, family detection,
engines on both CPU backends, image parity for every task, verify, bench, the SDXL VAE's fp32
rule and the TensorRT profiles of SDXL's inputs. (SD 1.x runs through every other test file.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import kasoku
from kasoku.cli import main
from kasoku.core.parity import psnr
from kasoku.families import FAMILIES, NotADiffusersPipeline, detect_family
from kasoku.model.loading import load_pipeline
from kasoku.pipeline.kasoku_pipeline import InvalidInput

pytestmark = pytest.mark.integration  # exports or builds engines

# SD 2 with v-prediction is the seed's model (stable-diffusion-2-1); epsilon only changes the scheduler.
TINY_ARGS = {"sd2": ["--family", "sd2", "--prediction", "v_prediction"], "sdxl": ["--family", "sdxl"]}
FAMILIES_UNDER_TEST = list(TINY_ARGS)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Each tiny family written once by the CLI, as a user would."""
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for family, args in TINY_ARGS.items():
        dirs[family] = root / f"tiny-{family}"
        assert main(["tiny", str(dirs[family]), *args]) == 0
    return dirs


@pytest.fixture(scope="module")
def family_pipes(family_dirs):
    return {family: load_pipeline(path) for family, path in family_dirs.items()}


@pytest.fixture(scope="module")
def family_kasoku(family_pipes, tiny_cache):
    """ONNX Runtime KasokuPipelines, compiled once per family into the session cache."""
    return {family: kasoku.compile(pipe, "onnxruntime", cache_dir=tiny_cache.root, label=family)
            for family, pipe in family_pipes.items()}


# ---- folders and detection --------------------------------------------------------------------


def test_tiny_sd2_folder_is_the_sd2_architecture(family_dirs):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(family_dirs["sd2"], safety_checker=None)
    assert detect_family(family_dirs["sd2"]).name == "sd2"
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.text_encoder.config.hidden_act == "gelu"  # OpenCLIP-style
    assert pipe.unet.config.use_linear_projection
    assert list(pipe.unet.config.attention_head_dim) == [2, 4]  # a head count per block
    assert pipe.tokenizer.pad_token == "!"


def test_tiny_sdxl_folder_loads_in_diffusers_sdxl_pipeline(family_dirs):
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextModelWithProjection

    pipe = StableDiffusionXLPipeline.from_pretrained(family_dirs["sdxl"])
    assert detect_family(family_dirs["sdxl"]).name == "sdxl"
    assert isinstance(pipe.text_encoder_2, CLIPTextModelWithProjection)
    assert pipe.unet.config.addition_embed_type == "text_time"
    assert pipe.unet.config.cross_attention_dim == (
        pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size)
    assert pipe.vae.config.force_upcast and pipe.vae.config.scaling_factor == pytest.approx(0.13025)


def test_tiny_cli_refuses_an_unknown_family(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["tiny", str(tmp_path / "x"), "--family", "sd4"])
    assert "invalid choice: 'sd4'" in capsys.readouterr().err


def test_a_class_diffusers_does_not_have_lists_what_kasoku_compiles(family_dirs, tmp_path):
    """Any diffusers pipeline class compiles (tests/families/test_generic.py); one diffusers does not have is
    refused in one line that says so."""
    import shutil

    folder = tmp_path / "made-up"
    shutil.copytree(family_dirs["sd2"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "MadeUpPipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(NotADiffusersPipeline, match="'MadeUpPipeline', which is not a pipeline class of the "
                                                    "installed diffusers") as error:
        load_pipeline(folder)
    for supported in ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusionXLInpaintPipeline",
                      "StableDiffusion3Pipeline", "FluxPipeline", "any other diffusers pipeline"):
        assert supported in str(error.value)
    assert main(["compile", str(folder), "--backend", "onnxruntime"]) == 1  # a clear error, no traceback


def test_sdxl_refiner_layout_is_refused(family_dirs, tmp_path):
    import shutil

    folder = tmp_path / "refiner"
    shutil.copytree(family_dirs["sdxl"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder"] = [None, None]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(NotADiffusersPipeline, match="without text_encoder"):
        detect_family(folder)


# ---- image parity: every task of every family ---------------------------------------------------


def _inputs(size: int = 64):
    rng = np.random.default_rng(5)
    image = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    return image, Image.fromarray(mask)


def _task_kwargs(task: str) -> dict:
    image, mask = _inputs()
    return {"txt2img": {}, "img2img": {"image": image, "strength": 0.7},
            "inpaint": {"image": image, "mask_image": mask, "strength": 0.9}}[task]


@pytest.mark.parametrize("task", ["txt2img", "img2img", "inpaint"])
@pytest.mark.parametrize("family", FAMILIES_UNDER_TEST)
def test_image_matches_diffusers(family, task, family_pipes, family_kasoku):
    reference = FAMILIES[family].task_pipeline(family_pipes[family], task)
    extra = _task_kwargs(task)
    if family == "sdxl":  # the added conditioning, through diffusers' own arguments
        extra.update(prompt_2=["a red car on a street", "a dog"], negative_prompt_2=["blurry", "dark"],
                     original_size=(96, 96), crops_coords_top_left=(8, 0), target_size=(64, 64))

    def run(pipe):
        return pipe(["a photo of a cat", "a castle in the snow"], negative_prompt=["low quality", "ugly"],
                    num_inference_steps=3, guidance_scale=6.0, generator=torch.Generator().manual_seed(3),
                    output_type="np", **extra).images

    expected, actual = run(reference), run(family_kasoku[family])
    assert expected.shape == actual.shape == (2, 64, 64, 3)
    assert psnr(expected, actual) >= 40.0


def test_sdxl_without_guidance_and_with_zeroed_negative(family_pipes, family_kasoku):
    """force_zeros_for_empty_prompt: no negative prompt means zero embeddings, one text pass per encoder."""
    reference = FAMILIES["sdxl"].task_pipeline(family_pipes["sdxl"], "txt2img")
    for guidance in (1.0, 5.0):
        def run(pipe, guidance=guidance):
            return pipe("a bird over the sea", num_inference_steps=2, guidance_scale=guidance,
                        generator=torch.Generator().manual_seed(1), output_type="np").images

        assert psnr(run(reference), run(family_kasoku["sdxl"])) >= 40.0
    calls = family_kasoku["sdxl"].times.calls
    assert calls["text_encoder"] > 0 and calls["text_encoder_2"] > 0


def test_compile_takes_sdxl_img2img_and_inpaint_pipelines(family_pipes, family_kasoku, tiny_cache):
    """Any of the three SDXL pipeline classes goes in; the engines come from the cache (same weights)."""
    for task in ("img2img", "inpaint"):
        source = FAMILIES["sdxl"].task_pipeline(family_pipes["sdxl"], task)
        fast = kasoku.compile(source, "onnxruntime", cache_dir=tiny_cache.root)
        assert fast.family.name == "sdxl"
        assert {s.status for s in fast.compile_report.stages} == {"reused"}
        image, mask = _inputs()
        kwargs = dict(image=image, strength=0.6, num_inference_steps=2, output_type="np",
                      generator=torch.Generator().manual_seed(0))
        if task == "inpaint":
            kwargs["mask_image"] = mask
        expected = source("a bird", **kwargs).images
        kwargs["generator"] = torch.Generator().manual_seed(0)
        assert psnr(expected, fast("a bird", **kwargs).images) >= 40.0


def test_family_arguments_are_checked_first(family_kasoku):
    sd2, sdxl = family_kasoku["sd2"], family_kasoku["sdxl"]
    sd2.times.reset()
    with pytest.raises(InvalidInput, match="only Stable Diffusion XL, Stable Diffusion 3 and Flux.1 pipelines take "
                                           "this argument"):
        sd2("a cat", prompt_2="a dog", num_inference_steps=1)
    with pytest.raises(InvalidInput, match="one text per prompt"):
        sdxl(["a cat", "a dog"], prompt_2="a bird", num_inference_steps=1)
    with pytest.raises(InvalidInput, match="original_size"):
        sdxl("a cat", original_size=(64, 64, 3), num_inference_steps=1)
    with pytest.raises(InvalidInput, match="clip_skip"):
        sdxl("a cat", clip_skip=1, num_inference_steps=1)
    assert not sd2.times.calls  # nothing ran before the errors


# ---- the other stages: verify on OpenVINO, bench, fp16 rule, TensorRT profiles ----------------------


@pytest.mark.parametrize("family", FAMILIES_UNDER_TEST)
def test_verify_on_openvino(family, family_dirs, tiny_cache, tmp_path):
    out = tmp_path / "verify.json"
    assert main(["verify", str(family_dirs[family]), "--backend", "openvino", "--cache-dir", str(tiny_cache.root),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["family"] == FAMILIES[family].title
    expected = {"text_encoder", "unet", "vae_decoder", "vae_encoder"} | ({"text_encoder_2"} if family == "sdxl"
                                                                         else set())
    assert {c["component"] for c in report["components"]} == expected
    assert report["image"]["psnr_db"] >= 40


@pytest.mark.parametrize("family", FAMILIES_UNDER_TEST)
def test_bench_times_every_component(family, family_dirs, family_kasoku, tiny_cache, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", str(family_dirs[family]), "--backends", "onnxruntime", "--steps", "2", "--repeats", "3",
                 "--cache-dir", str(tiny_cache.root), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [c["component"] for c in report["components"]]
    assert names == list(FAMILIES[family].text_encoders) + ["unet", "vae_decoder", "vae_encoder"]
    for component in report["components"]:
        assert component["results"]["onnxruntime"]["max_abs_vs_torch"] < 1e-3
    end_to_end = report["end_to_end"]["results"]
    kasoku_run = next(r for name, r in end_to_end.items() if name.startswith("kasoku"))
    assert kasoku_run["max_abs_vs_diffusers"] < 1e-3


def test_sdxl_vae_stays_fp32_unless_a_fp16_safe_vae_is_given(family_dirs, tiny_cache):
    from kasoku.pipeline.compiling import compile_components
    from kasoku.tools.tiny import tiny_pipeline

    pipe = load_pipeline(family_dirs["sdxl"])
    engines, report = compile_components(pipe, backend="onnxruntime", precision="fp16", components=["vae_decoder"],
                                         cache=tiny_cache)
    assert report.precisions == {"vae_decoder": "fp32"} and engines["vae_decoder"].precision.value == "fp32"
    assert len(report.notes) == 1 and "overflows in fp16" in report.notes[0] and "fp16-safe" in report.notes[0]

    safe = tiny_pipeline(family="sdxl")
    safe.vae.register_to_config(force_upcast=False)  # what madebyollin/sdxl-vae-fp16-fix declares
    engines, report = compile_components(safe, backend="onnxruntime", precision="fp16", components=["vae_decoder"],
                                         cache=tiny_cache)
    assert report.precisions == {"vae_decoder": "fp16"} and not report.notes


def test_tensorrt_profiles_cover_sdxl_inputs(family_pipes):
    from kasoku.backends.tensorrt import trt_profile
    from kasoku.model.pipeline_model import component_specs

    specs = component_specs(family_pipes["sdxl"])
    unet = trt_profile(specs["unet"])
    assert set(unet) == {"sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"}
    # tiny profile: 1..4 images (2x under guidance, 1x without), width 32 + 48 of the two encoders
    assert unet["encoder_hidden_states"] == ((1, 77, 80), (2, 77, 80), (8, 77, 80))
    assert unet["text_embeds"] == ((1, 40), (2, 40), (8, 40))
    assert unet["time_ids"] == ((1, 6), (2, 6), (8, 6))
    assert trt_profile(specs["text_encoder_2"])["input_ids"] == ((1, 77), (1, 77), (4, 77))
    assert specs["text_encoder_2"].output_names == ("text_embeds", "penultimate_hidden_state")


def test_generate_sdxl_from_the_cli(family_dirs, family_kasoku, tiny_cache, tmp_path, capsys):
    out = tmp_path / "xl.png"
    assert main(["generate", str(family_dirs["sdxl"]), "a castle", "--prompt-2", "a castle at night",
                 "--steps", "2", "--backend", "onnxruntime", "--cache-dir", str(tiny_cache.root),
                 "-o", str(out)]) == 0
    assert Image.open(out).size == (64, 64)
    printed = capsys.readouterr().out
    assert "text_encoder_2=onnxruntime" in printed


@pytest.mark.slow(reason="SDXL's IP-Adapter (SD 1.x's, SD3's stay)")
@pytest.mark.integration
def test_sdxl_runs_an_ip_adapter_image_prompt(family_kasoku, tmp_path):
    """IP-Adapter on SDXL (its two text encoders, its added conditioning): the family's engines plus the image
    encoder and the U-Net with image-prompt inputs give diffusers' image (tests/runtime/test_ip_adapter.py has the
    rest)."""
    from kasoku.tools.tiny import tiny_pipeline, write_tiny_ip_adapters
    from tests.runtime.test_ip_adapter import PLAIN, image, picture, reference

    write_tiny_ip_adapters(tmp_path / "xl", tiny_pipeline(family="sdxl").unet)
    ours = family_kasoku["sdxl"]
    ours.load_ip_adapter(str(tmp_path / "xl"), subfolder="", weight_name=PLAIN)
    try:
        theirs = reference(tmp_path, PLAIN, folders=("xl",), pipe=tiny_pipeline(family="sdxl"))
        assert psnr(image(theirs, ip_adapter_image=picture(1)), image(ours, ip_adapter_image=picture(1))) >= 40.0
    finally:
        ours.unload_ip_adapter()
