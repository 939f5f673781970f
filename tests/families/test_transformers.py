"""SD3 and Flux.1 (the transformer denoisers) through the whole flow, on their tiny pipelines: detection, every
task with and without guidance against diffusers' own pipelines (Flux dev's embedded guidance, schnell's
none, true CFG), SD3 without its T5, LoRA, the flow-matching schedulers, the T5 tokens the engines fix, and
the commands (tiny, generate, verify, bench, batch, serve)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

import kasoku
from kasoku.cli import main
from kasoku.core.components import Precision
from kasoku.core.parity import TOLERANCES, psnr, ssim
from kasoku.families import FAMILIES, detect_family
from kasoku.model.loading import load_pipeline
from kasoku.model.pipeline_model import Model
from kasoku.pipeline.kasoku_pipeline import InvalidInput
from tests.conftest import TINY_SIZES_FLAG, quantized_linear_layers, save_transformer_adapter, tiny_profile

pytestmark = pytest.mark.integration  # exports or builds engines

FAMILY_NAMES = ("sd3", "flux")
STEPS = 3
BOUND_DB = TOLERANCES[Precision.FP32].image_psnr_db
# Guidance settings per family: diffusers' default; none; and a stronger one (Flux: true CFG with a negative).
GUIDANCE = {"sd3": [{}, {"guidance_scale": 1.0}, {"guidance_scale": 4.0, "negative_prompt": "blurry"}],
            "flux": [{}, {"guidance_scale": 1.0}, {"true_cfg_scale": 2.0, "negative_prompt": "blurry"}]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Each family's tiny folder, written by the CLI as a user would."""
    root = tmp_path_factory.mktemp("transformers")
    for name in FAMILY_NAMES:
        assert main(["tiny", str(root / name), "--family", name]) == 0
    return {name: root / name for name in FAMILY_NAMES}


@pytest.fixture(scope="module")
def pipes(dirs):
    """diffusers' pipelines from the folders, and a Flux.1 schnell layout (no guidance embedding)."""
    from kasoku.tools.tiny import tiny_pipeline

    pipes = {name: load_pipeline(path) for name, path in dirs.items()}
    schnell = tiny_pipeline(family="flux")
    schnell.register_modules(transformer=FAMILIES["flux"].tiny_transformer(guidance=False).eval())
    pipes["schnell"] = schnell
    return pipes


@pytest.fixture(scope="module")
def compiled(pipes, tiny_cache):
    """ONNX Runtime and OpenVINO pipelines of each (the second backend reuses the exported graphs)."""
    return {(name, backend): kasoku.compile(pipe, backend, profile=tiny_profile(pipe), cache_dir=tiny_cache.root,
                                            label=name)
            for name, pipe in pipes.items() for backend in ("onnxruntime", "openvino")
            if (name, backend) != ("schnell", "openvino")}  # schnell differs from dev by an input: ORT proves it


def call(pipe, task, seed=0, steps=STEPS, **kwargs):
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    inputs = {"txt2img": {}, "img2img": {"image": image, "strength": 0.7},
              "inpaint": {"image": image, "mask_image": Image.fromarray(mask)}}[task]
    return pipe("a photo of a cat", num_inference_steps=steps, height=64, width=64, output_type="np",
                generator=torch.Generator().manual_seed(seed), **inputs, **kwargs).images


# ---- unit-like checks on the folders and specs ----------------------------------------------------


def test_folders_are_detected_as_their_family(dirs, pipes):
    assert detect_family(dirs["sd3"]).name == "sd3" and detect_family(dirs["flux"]).name == "flux"
    assert Model.of(pipes["sd3"]).components == ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer",
                                                 "vae_decoder", "vae_encoder")
    assert Model.of(pipes["flux"]).components == ("text_encoder", "text_encoder_2", "transformer", "vae_decoder",
                                                  "vae_encoder")
    assert list(pipes["sd3"].transformer.config.dual_attention_layers) == [0]  # SD3.5's layers
    assert pipes["sd3"].transformer.config.qk_norm == "rms_norm"


def test_transformer_specs_say_what_the_pipelines_feed(pipes):
    from kasoku.core.components import ImageShape

    sd3 = Model.of(pipes["sd3"]).specs(names=["transformer"])["transformer"]
    # CLIP's 77 tokens beside T5's 256 (diffusers' default max_sequence_length), 2 x the images under guidance
    assert sd3.input_shapes(ImageShape(1, 64, 96))["encoder_hidden_states"] == (2, 77 + 256, 80)
    flux = Model.of(pipes["flux"]).specs(tiny_profile(pipes["flux"]), names=["transformer"])["transformer"]
    shapes = flux.input_shapes(ImageShape(1, 64, 96))
    assert shapes["hidden_states"] == (1, 4 * 6, 64)  # 2x2 patches of the 8x latent: one axis of height x width
    assert shapes["img_ids"] == (24, 3) and shapes["txt_ids"] == (512, 3) and shapes["guidance"] == (1,)
    schnell = Model.of(pipes["schnell"]).specs(tiny_profile(pipes["schnell"]), names=["transformer"])["transformer"]
    assert "guidance" not in schnell.input_names


# ---- images against diffusers ------------------------------------------------------------------------


CASES = [(name, backend) for name in ("sd3", "flux", "schnell") for backend in ("onnxruntime", "openvino")
         if (name, backend) != ("schnell", "openvino")]


@pytest.mark.parametrize("task", ["txt2img", "img2img", "inpaint"])
@pytest.mark.parametrize("name, backend", CASES)
def test_every_task_matches_diffusers(name, task, backend, pipes, compiled):
    family = Model.of(pipes[name]).family
    reference = family.task_pipeline(pipes[name], task)
    fast = compiled[(name, backend)]
    for guidance in GUIDANCE["flux" if name == "schnell" else name]:
        fixed = fast.fixed_arguments  # the T5 tokens the engines were built for (diffusers' default here)
        expected = call(reference, task, **guidance, **fixed)
        fast.times.reset()
        actual = call(fast, task, **guidance)
        assert psnr(expected, actual) >= BOUND_DB, (guidance, psnr(expected, actual))
        assert fast.times.calls["text_encoder"] == (2 if guidance.get("negative_prompt") or
                                                    (name == "sd3" and guidance.get("guidance_scale", 7) > 1) else 1)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_int8_runs_the_transformers_quantized_linear_layers_in_int8_within_the_contract(name, pipes, compiled,
                                                                                      tiny_cache):
    pipe, contract = pipes[name], TOLERANCES[Precision.INT8]
    fast = kasoku.compile(pipe, "openvino", precision="int8", profile=tiny_profile(pipe), cache_dir=tiny_cache.root)
    recipes = {s.component: s.detail["int8"] for s in fast.compile_report.stages if s.stage == "engine"}
    assert recipes["transformer"] == {"recipe": "full", "calibration_samples": 32}
    assert {r["recipe"] for c, r in recipes.items() if c != "transformer"} == {"weights"}
    # NNCF quantizes the linear layers (it may leave one or two in float: which depends on its statistics, measured on
    # this CPU); OpenVINO runs every quantized one in int8
    linear = quantized_linear_layers(fast.engines["transformer"])
    quantized = [precision for precision, fused in linear if fused]
    assert len(linear) > 20 and len(quantized) >= 0.9 * len(linear), linear
    assert set(quantized) <= {"u8", "i8"}, linear
    expected = call(compiled[(name, "openvino")], "txt2img", steps=contract.image_steps)
    actual = call(fast, "txt2img", steps=contract.image_steps)
    assert psnr(expected, actual) >= contract.image_psnr_db and ssim(expected, actual) >= contract.image_ssim


def test_flux_true_cfg_runs_the_transformer_twice_a_step(compiled):
    fast = compiled[("flux", "onnxruntime")]
    fast.times.reset()
    call(fast, "txt2img")
    plain = fast.times.calls["transformer"]
    fast.times.reset()
    call(fast, "txt2img", true_cfg_scale=2.0, negative_prompt="blurry")
    assert plain == STEPS and fast.times.calls["transformer"] == 2 * STEPS


def test_sd3_runs_without_its_t5(pipes, tiny_cache):
    without = FAMILIES["sd3"].task_pipeline(pipes["sd3"], "txt2img", text_encoder_3=None, tokenizer_3=None)
    fast = kasoku.compile(without, "onnxruntime", profile=tiny_profile(without), cache_dir=tiny_cache.root)
    assert "text_encoder_3" not in fast.engines
    assert psnr(call(without, "txt2img", max_sequence_length=256), call(fast, "txt2img")) >= BOUND_DB


# ---- what the engines fix, and the schedulers -----------------------------------------------------


def test_a_max_sequence_length_the_engines_do_not_serve_is_refused_first(compiled):
    fast = compiled[("sd3", "onnxruntime")]
    fast.times.reset()
    with pytest.raises(InvalidInput, match=r"`max_sequence_length` is 64 but the engines were compiled for 256 T5 "
                                           r"tokens.*text_tokens=64.*leave out `profile=`"):
        call(fast, "txt2img", max_sequence_length=64)
    assert not fast.times.calls  # refused before any engine ran
    assert fast.fixed_arguments == {"max_sequence_length": 256}


def test_a_profile_with_other_text_tokens_builds_engines_for_them(pipes, tiny_cache):
    from dataclasses import replace

    profile = replace(tiny_profile(pipes["flux"]), text_tokens=32)
    fast = kasoku.compile(pipes["flux"], "torch", profile=profile, cache_dir=tiny_cache.root,
                          components=("text_encoder", "text_encoder_2", "transformer", "vae_decoder"))
    assert fast.engines["text_encoder_2"].spec.input_shapes(profile.opt)["input_ids"][1] == 32
    expected = call(pipes["flux"], "txt2img", max_sequence_length=32)
    assert psnr(expected, call(fast, "txt2img")) >= BOUND_DB  # 32 tokens given to diffusers' call, not 512


def test_flow_matching_schedulers_by_name(compiled):
    fast = compiled[("flux", "onnxruntime")]
    original = fast.scheduler
    try:
        fast.set_scheduler("flow-heun")
        assert type(fast.scheduler).__name__ == "FlowMatchHeunDiscreteScheduler"
        with pytest.raises(InvalidInput, match=r"scheduler 'ddim' does not fit.*choose from flow-euler, flow-heun"):
            fast.set_scheduler("ddim")
    finally:
        fast.scheduler = original


def test_u_net_models_are_offered_the_noise_schedulers_only(tiny_kasoku):
    with pytest.raises(InvalidInput, match=r"'flow-euler' does not fit.*choose from ddim, pndm"):
        tiny_kasoku.set_scheduler("flow-euler")


def test_a_step_cache_method_of_another_denoiser_is_refused_with_the_reason(compiled):
    with pytest.raises(InvalidInput, match="`cache_method` 'deepcache': this denoiser runs first-block, taylorseer"):
        call(compiled[("sd3", "onnxruntime")], "txt2img", cache_interval=2, cache_method="deepcache")


# ---- LoRA: diffusers' files on the transformer, rebound without re-export ----------------------------


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow(reason="Flux's LoRA; SD3's runs"))
                                  if name == "flux" else name for name in FAMILY_NAMES])
def test_lora_one_adapter_and_two_blended(name, pipes, tiny_cache, tmp_path, request):
    from kasoku.tools.tiny import tiny_pipeline

    a = save_transformer_adapter(pipes[name], tmp_path / "a", 1, ["to_q", "to_k", "to_v", "to_out.0"])
    b = save_transformer_adapter(pipes[name], tmp_path / "b", 2, ["to_q", "to_v", "add_k_proj", "proj_out"])
    reference = tiny_pipeline(family=name)
    fast = kasoku.compile(tiny_pipeline(family=name), "onnxruntime", profile=tiny_profile(reference),
                          cache_dir=tiny_cache.root, lora_targets="attention", label=f"{name}-lora")
    fixed = fast.fixed_arguments
    base = call(fast, "txt2img")
    for pipe in (reference, fast):
        pipe.load_lora_weights(str(a), adapter_name="a")
    one = call(fast, "txt2img")
    assert psnr(call(reference, "txt2img", **fixed), one) >= BOUND_DB and psnr(base, one) < 60  # it changes it
    for pipe in (reference, fast):
        pipe.load_lora_weights(str(b), adapter_name="b")
        pipe.set_adapters(["a", "b"], [0.7, 0.5])
    assert psnr(call(reference, "txt2img", **fixed), call(fast, "txt2img")) >= BOUND_DB
    if name == "flux":  # LoRA and an IP-Adapter at once
        for pipe in (reference, fast):
            pipe.load_ip_adapter(**flux_ip_arguments(request.getfixturevalue("flux_adapters"), "a"))
            pipe.set_ip_adapter_scale(0.8)
        prompt = {"ip_adapter_image": ip_picture()}
        assert psnr(call(reference, "txt2img", **prompt, **fixed), call(fast, "txt2img", **prompt)) >= BOUND_DB
        fast.unload_ip_adapter()
    fast.unload_lora_weights()
    assert np.array_equal(call(fast, "txt2img"), base)  # the base weights exactly


# ---- IP-Adapters on Flux (XLabs' kind): diffusers' loader and arguments, image prompts as engine inputs --------


@pytest.fixture(scope="module")
def flux_adapters(tmp_path_factory, pipes):
    """Two tiny Flux IP-Adapter folders (each a plain adapter and its image encoder)."""
    from kasoku.tools.tiny import write_tiny_ip_adapters

    root = tmp_path_factory.mktemp("flux-ip")
    for folder, seed in (("a", 0), ("b", 5)):
        write_tiny_ip_adapters(root / folder, pipes["flux"].transformer, seed=seed)
    return root


def flux_ip_arguments(root, *folders):
    """diffusers' Flux `load_ip_adapter` arguments for the tiny adapters in `folders` (the first's image encoder)."""
    from kasoku.tools.tiny import IP_ADAPTER_FILES

    return dict(pretrained_model_name_or_path_or_dict=[str(root / f) for f in folders],
                weight_name=[IP_ADAPTER_FILES["plain"]] * len(folders),
                image_encoder_pretrained_model_name_or_path=str(root / folders[0] / "image_encoder"),
                image_encoder_dtype=torch.float32)


def with_ip_adapter(dirs, pipes, tiny_cache, name, backend, *args, **kwargs):
    """(ours, diffusers', ours' image before the load): the tiny `name` folder compiled on `backend` and diffusers'
    own pipeline of it, each given `load_ip_adapter(*args, **kwargs)`."""
    reference, ours = load_pipeline(dirs[name]), kasoku.compile(load_pipeline(dirs[name]), backend,
                                                                profile=tiny_profile(pipes[name]),
                                                                cache_dir=tiny_cache.root, label=f"{name}-ip")
    base = call(ours, "txt2img")
    for pipe in (reference, ours):
        pipe.load_ip_adapter(*args, **kwargs)
    return ours, reference, base


@pytest.fixture(scope="module")
def flux_ip(dirs, pipes, tiny_cache, flux_adapters):
    """(ours, diffusers', ours' image before the load): the tiny Flux dev on ONNX Runtime and diffusers' own, the
    adapter "a" loaded in each."""
    return with_ip_adapter(dirs, pipes, tiny_cache, "flux", "onnxruntime", **flux_ip_arguments(flux_adapters, "a"))


def ip_picture(seed=1):
    return Image.fromarray((np.random.RandomState(seed).rand(64, 64, 3) * 255).astype("uint8"))


@pytest.mark.parametrize("task", ["txt2img", "img2img", "inpaint"])
def test_flux_ip_adapter_every_task_matches_diffusers(task, flux_ip):
    ours, reference, base = flux_ip
    for pipe in (reference, ours):
        pipe.set_ip_adapter_scale(0.8)
    assert [t.name for t in ours.engines["transformer"].spec.inputs][-2:] == ["ip_embeds_0", "ip_scale"]
    prompt = {"ip_adapter_image": ip_picture()}
    expected = call(Model.of(reference).family.task_pipeline(reference, task), task, **prompt, **ours.fixed_arguments)
    actual = call(ours, task, **prompt)
    assert psnr(expected, actual) >= BOUND_DB
    if task == "txt2img":
        assert psnr(base, actual) < 60  # the image prompt changes the image


def test_flux_ip_scales_per_block_and_true_cfg_build_nothing(flux_ip, tiny_cache):
    ours, reference, _ = flux_ip
    built = {entry.key for entry in tiny_cache.list()}
    layers = reference.transformer.config.num_layers
    for scale in (0.3, [[0.5] * layers], [0.9] * layers):  # a number, per block per adapter, one adapter's blocks
        for pipe in (reference, ours):
            pipe.set_ip_adapter_scale(scale)
        prompt = {"ip_adapter_image": ip_picture(), "true_cfg_scale": 2.0, "negative_prompt": "blurry",
                  "negative_ip_adapter_image": ip_picture(2)}
        ours.times.reset()
        actual = call(ours, "txt2img", **prompt)
        assert psnr(call(reference, "txt2img", **prompt, **ours.fixed_arguments), actual) >= BOUND_DB, scale
        assert ours.times.calls["transformer"] == 2 * STEPS and ours.times.calls["image_encoder"] == 2
    assert {entry.key for entry in tiny_cache.list()} == built  # scales are inputs: no graph, no engine
    embeds = ours.prepare_ip_adapter_image_embeds(ip_picture(), None, None, 1)
    assert psnr(call(ours, "txt2img", ip_adapter_image=ip_picture()),
                call(ours, "txt2img", ip_adapter_image_embeds=embeds)) >= 100  # embeds == the image they encode
    with pytest.raises(InvalidInput, match="one image per IP-Adapter"):
        ours("a cat", ip_adapter_image=[ip_picture(), ip_picture(2)], num_inference_steps=1, height=64, width=64)


@pytest.mark.slow(reason="two Flux IP-Adapters (SD3's and SDXL's adapter tests stay in make test)")
def test_flux_two_adapters_then_unload_gives_the_base_images_exactly(dirs, pipes, tiny_cache, flux_adapters):
    ours, reference, base = with_ip_adapter(dirs, pipes, tiny_cache, "flux", "openvino",
                                            **flux_ip_arguments(flux_adapters, "a", "b"))
    for pipe in (reference, ours):
        pipe.set_ip_adapter_scale([0.6, 0.4])
    prompt = {"ip_adapter_image": [ip_picture(), ip_picture(3)]}
    assert psnr(call(reference, "txt2img", **prompt, **ours.fixed_arguments), call(ours, "txt2img", **prompt)) \
        >= BOUND_DB
    ours.unload_ip_adapter()
    assert "image_encoder" not in ours.engines and np.array_equal(call(ours, "txt2img"), base)


@pytest.mark.slow(reason="Flux's IP-Adapter through the CLI (the Python tests cover the adapter)")
def test_flux_ip_adapter_from_the_cli(dirs, tiny_cache, flux_adapters, tmp_path):
    from kasoku.tools.tiny import IP_ADAPTER_FILES

    out = tmp_path / "ip.png"
    picture = tmp_path / "prompt.png"
    ip_picture().save(picture)
    assert main(["generate", str(dirs["flux"]), "a castle", "--steps", "2", "--height", "64", "--width", "64",
                 "--backend", "onnxruntime", "--cache-dir", str(tiny_cache.root), "--ip-adapter",
                 str(flux_adapters / "a" / IP_ADAPTER_FILES["plain"]), "--ip-image", str(picture), "--ip-scale", "0.7",
                 "-o", str(out)]) == 0
    assert Image.open(out).size == (64, 64)
    assert main(["tiny", str(tmp_path / "t"), "--family", "flux", "--ip-adapter"]) == 0
    assert (tmp_path / "t" / "ip_adapter" / IP_ADAPTER_FILES["plain"]).is_file()
    assert not (tmp_path / "t" / "ip_adapter" / IP_ADAPTER_FILES["plus"]).exists()  # Flux's come plain only


@pytest.fixture(scope="module")
def sd3_ip(dirs, pipes, tiny_cache, tmp_path_factory):
    """(ours, diffusers', ours' image before the load, the adapter folder): the tiny SD3.5 layout on ONNX Runtime
    and diffusers' own, a tiny InstantX-kind IP-Adapter (SigLIP image encoder) loaded in each, by diffusers' SD3
    arguments (source, weight_name, subfolder, image_encoder_folder)."""
    from kasoku.tools.tiny import write_tiny_ip_adapters

    folder = write_tiny_ip_adapters(tmp_path_factory.mktemp("sd3-ip") / "a", pipes["sd3"].transformer, seed=0)
    return (*with_ip_adapter(dirs, pipes, tiny_cache, "sd3", "onnxruntime", *sd3_ip_arguments(folder)), folder)


def sd3_ip_arguments(folder):
    """diffusers' SD3 `load_ip_adapter` arguments, by position, for the tiny adapter in `folder`."""
    from kasoku.tools.tiny import IP_ADAPTER_FILES

    return str(folder), IP_ADAPTER_FILES["plain"], "", str(folder / "image_encoder")


@pytest.mark.parametrize("task", ["txt2img", "img2img", "inpaint"])
def test_sd3_ip_adapter_every_task_matches_diffusers(task, sd3_ip):
    ours, reference, base, _ = sd3_ip
    for pipe in (reference, ours):
        pipe.set_ip_adapter_scale(0.7)
    assert [t.name for t in ours.engines["image_encoder"].spec.outputs] == ["penultimate_hidden_states"]  # SigLIP
    prompt = {"ip_adapter_image": ip_picture()}
    for guidance in GUIDANCE["sd3"][::2]:  # diffusers' default (guided) and a stronger one with a negative prompt
        expected = call(Model.of(reference).family.task_pipeline(reference, task), task, **prompt, **guidance,
                        **ours.fixed_arguments)
        assert psnr(expected, call(ours, task, **prompt, **guidance)) >= BOUND_DB
    if task == "txt2img":
        assert psnr(base, call(ours, task, **prompt)) < 60  # the image prompt changes the image


def test_sd3_ip_scale_zero_embeds_and_unload(sd3_ip, tiny_cache):
    ours, reference, base, _ = sd3_ip
    built = {entry.key for entry in tiny_cache.list()}
    for pipe in (reference, ours):
        pipe.set_ip_adapter_scale(0.0)  # diffusers then passes no image encoding: the engine runs it at scale 0
    prompt = {"ip_adapter_image": ip_picture()}
    assert psnr(call(reference, "txt2img", **prompt, **ours.fixed_arguments), call(ours, "txt2img", **prompt)) \
        >= BOUND_DB
    ours.set_ip_adapter_scale(0.5)
    embeds = ours.prepare_ip_adapter_image_embeds(ip_picture(), None, None, 1, True)
    assert psnr(call(ours, "txt2img", **prompt), call(ours, "txt2img", ip_adapter_image_embeds=embeds)) >= 100
    assert {entry.key for entry in tiny_cache.list()} == built  # the scale is an input
    with pytest.raises(InvalidInput, match="ip_adapter_image_embeds"):
        ours("a cat", ip_adapter_image_embeds=embeds[:, :3], num_inference_steps=1)
    ours.unload_ip_adapter()
    try:
        assert np.array_equal(call(ours, "txt2img"), base)  # the base engine again: exactly its images
    finally:
        ours.load_ip_adapter(*sd3_ip_arguments(sd3_ip[3]))


def test_sd3_ip_adapter_on_openvino_and_from_the_cli(dirs, tiny_cache, sd3_ip, tmp_path):
    from kasoku.tools.tiny import IP_ADAPTER_FILES

    _, reference, _, folder = sd3_ip
    ours = kasoku.compile(load_pipeline(dirs["sd3"]), "openvino", cache_dir=tiny_cache.root, label="sd3-ip-ov")
    ours.load_ip_adapter(*sd3_ip_arguments(folder))
    for pipe in (reference, ours):
        pipe.set_ip_adapter_scale(0.9)
    prompt = {"ip_adapter_image": ip_picture()}
    assert psnr(call(reference, "txt2img", **prompt, **ours.fixed_arguments), call(ours, "txt2img", **prompt)) \
        >= BOUND_DB
    picture, out = tmp_path / "prompt.png", tmp_path / "ip.png"
    ip_picture().save(picture)
    assert main(["generate", str(dirs["sd3"]), "a castle", "--steps", "2", "--backend", "onnxruntime",
                 "--cache-dir", str(tiny_cache.root), "--ip-adapter", str(folder / IP_ADAPTER_FILES["plain"]),
                 "--ip-image", str(picture), "-o", str(out)]) == 0
    assert Image.open(out).size == (64, 64)


# ---- the commands ---------------------------------------------------------------------------------------


def test_generate_sd3_from_the_cli(dirs, compiled, tiny_cache, tmp_path, capsys):
    out = tmp_path / "sd3.png"
    assert main(["generate", str(dirs["sd3"]), "a castle", "--prompt-3", "a castle on a hill, long description",
                 "--steps", "2", "--backend", "onnxruntime", "--cache-dir", str(tiny_cache.root), "-o", str(out)]) == 0
    assert Image.open(out).size == (64, 64)
    printed = capsys.readouterr().out
    assert "text_encoder_3=onnxruntime" in printed and "transformer" in printed
    assert "0 built" not in printed  # (generate prints no build count; the engines came from the cache)


def test_verify_flux_on_openvino_from_the_cli(dirs, compiled, tiny_cache, tmp_path):
    out = tmp_path / "verify.json"
    assert main(["verify", str(dirs["flux"]), "--backend", "openvino", "--height", TINY_SIZES_FLAG,
                 "--width", TINY_SIZES_FLAG, "--cache-dir", str(tiny_cache.root), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["family"] == "Flux.1" and report["image"]["psnr_db"] >= BOUND_DB
    assert {c["component"] for c in report["components"]} == {"text_encoder", "text_encoder_2", "transformer",
                                                                "vae_decoder", "vae_encoder"}


def test_bench_times_the_transformer_against_torch(pipes, tiny_cache):
    report = kasoku.bench(pipes["sd3"], ["onnxruntime"], components=["transformer"], repeats=3, end_to_end=False,
                          cache_dir=tiny_cache.root)
    (transformer,) = report.components
    assert transformer.component == "transformer" and transformer.gflop > 0
    assert transformer.results["onnxruntime"].max_abs_vs_torch < 1e-4


def test_batch_jobs_on_sd3(dirs, compiled, tiny_cache, tmp_path):
    from kasoku.batch import prepare, run_local

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(json.dumps(j) for j in (
        {"prompt": "a cat", "seed": 1, "steps": 2}, {"prompt": "a dog", "seed": 2, "steps": 2, "guidance": 1.0},
        {"prompt": "a bird", "seed": 3, "steps": 2, "height": 32, "width": 32})) + "\n")
    from kasoku.batch import read_jobs

    plan = prepare(str(dirs["sd3"]), read_jobs(jobs), tmp_path / "out", backend="onnxruntime",
                   cache_dir=tiny_cache.root)
    result = run_local(plan)
    assert result.jobs == 3 and sorted(p.name for p in (tmp_path / "out").glob("*.png")) == \
        ["000001.png", "000002.png", "000003.png"]
    fast = compiled[("sd3", "onnxruntime")]
    expected = fast("a cat", num_inference_steps=2, guidance_scale=7.0, height=64, width=64,  # SD3's default
                    generator=torch.Generator().manual_seed(1)).images[0]
    assert np.array_equal(np.asarray(expected), np.asarray(Image.open(tmp_path / "out" / "000001.png")))


def test_serve_sd3_answers_the_images_api(dirs, compiled, tiny_cache):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kasoku.core.options import CompileOptions
    from kasoku.serve import ImageService, prepare_serving
    from kasoku.serve.app import create_app
    from kasoku.serve.config import Size

    config, reference = prepare_serving(str(dirs["sd3"]), CompileOptions(backend="onnxruntime",
                                                                         cache_dir=tiny_cache.root),
                                        sizes=(Size(64, 64),), max_batch=2)
    service = ImageService(config)
    service.load(reference)
    with TestClient(create_app(service)) as client:
        answer = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "steps": 2,
                                                              "seed": 5, "response_format": "b64_json"})
        assert answer.status_code == 200, answer.text
        image = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
    assert image.size == (64, 64)
    assert service.startup["engines_built"] == 0  # the default profile's engines, from the cache


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_inductor_builds_the_transformer(name, pipes, tmp_path):
    from kasoku.pipeline.compiling import compile_components

    engines, report = compile_components(pipes[name], backend="inductor", profile=tiny_profile(pipes[name]),
                                         components=("transformer",), cache=tmp_path)
    (stage,) = report.stages
    assert stage.status == "built" and all(p["passed"] for p in stage.detail["parity"])
