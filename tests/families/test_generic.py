"""Pipelines kasoku has no hand-written family for, compiled from the calls diffusers makes to their components.

Each tiny family (kasoku.tools.tiny_families, at the sizes of diffusers' own tests) is compiled once per backend
into a session cache and compared with diffusers' own pipeline on the same generator. `make test` runs a few
families on ONNX Runtime and one on OpenVINO; `make test-slow` runs every family on both.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import numpy as np
import pytest
import torch

import kasoku
from kasoku.architectures.recorded import signatures
from kasoku.core.components import Axis, ShapeOutOfProfile, ShapeProfile
from kasoku.core.parity import psnr
from kasoku.core.recording import _flatten_with_paths
from kasoku.core.standins import InvalidInput
from kasoku.families import NotADiffusersPipeline, classify
from kasoku.families.generic import GenericFamily
from kasoku.model.pipeline_model import Model
from kasoku.tools.tiny_families import TINY_FAMILIES, tiny_family_pipeline

# The families whose denoiser runs on an engine; the others' denoisers stay in torch, with the reason the
# compile report gives (their text encoders and VAEs run on engines).
DENOISER_IN_TORCH = ("lumina2", "hunyuan-image")
# of those, the ones whose every block runs on an engine (their glue, where the whole graph failed, in torch)
BLOCKS_ON_ENGINES = ("lumina2", "hunyuan-image")
DENOISER_ON_ENGINES = tuple(name for name in TINY_FAMILIES if name not in DENOISER_IN_TORCH)
# the families `make test` compiles: dynamic graphs (PixArt-Σ), a transformer of one shape (Chroma's attention mask
# is as long as its text and image tokens together), one kept in torch (Lumina 2's does not export)
FAST = ("pixart-sigma", "chroma", "lumina2")
MIN_PSNR = 40.0


def _multiple(pipe) -> int:
    model = Model.of(pipe)
    return model.family.pixel_multiple(model)


def _profile(pipe, max_batch: int | None = None, largest: int | None = None) -> ShapeProfile:
    """2x to 8x the pipeline's pixel step (up to `largest` pixels where given), 48 text tokens."""
    step = max(16, _multiple(pipe))
    if max_batch is None:  # PRX's pipeline makes one image per call (it fails in diffusers for two)
        max_batch = 1 if type(pipe).__name__ == "PRXPipeline" else 2
    sides = (2 * step, 4 * step, largest or 8 * step)
    profile = ShapeProfile.from_ranges((1, 1, max_batch), sides, sides, step)
    return dataclasses.replace(profile, text_tokens=48)  # the calls' max_sequence_length (graphs of one shape)


def _arguments(pipe, *, guided: bool | None = None, **given) -> dict:
    """A call every class of the family takes: its own size, 2 steps, the guidance asked for."""
    parameters = inspect.signature(type(pipe).__call__).parameters
    step = max(16, _multiple(pipe))
    arguments = {"prompt": "a red fox", "height": 4 * step, "width": 4 * step, "num_inference_steps": 2,
                 "output_type": "np", "use_resolution_binning": False, "max_sequence_length": 48,
                 "enable_prompt_rewrite": False, **given}
    if guided is not None:
        arguments["guidance_scale"] = 4.5 if guided else 1.0
        arguments.setdefault("guidance_schedule", None)  # Ideogram 4's per-step default: one of the two is given
    return {name: value for name, value in arguments.items() if name in parameters}


def _images(pipe, **call) -> np.ndarray:
    output = pipe(generator=torch.Generator().manual_seed(1), **call)
    return np.asarray(output.images if hasattr(output, "images") else output.image)


@pytest.fixture(scope="session")
def generic_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("generic-cache")


_compiled: dict[tuple[str, str], tuple] = {}


def compiled(family: str, backend: str, cache) -> tuple:
    """(diffusers pipeline, kasoku pipeline) of the tiny `family` on `backend`, compiled once per session."""
    if (family, backend) not in _compiled:
        pipe = tiny_family_pipeline(family)
        _compiled[family, backend] = pipe, kasoku.compile(pipe, backend, profile=_profile(pipe), cache_dir=cache)
    return _compiled[family, backend]


# ---- recognising any diffusers pipeline ----------------------------------------------------------------------


def test_any_diffusers_pipeline_class_gets_a_generic_family():
    family = classify("AuraFlowPipeline", {"transformer": object()}, {})
    assert isinstance(family, GenericFamily) and family.title == "AuraFlow"
    assert family is classify("AuraFlowPipeline", {"transformer": object()}, {})
    chroma = classify("ChromaPipeline", {"transformer": object()}, {})
    assert chroma.pipelines == {"txt2img": "ChromaPipeline", "img2img": "ChromaImg2ImgPipeline",
                                "inpaint": "ChromaInpaintPipeline"}


def test_a_class_diffusers_does_not_have_is_refused():
    with pytest.raises(NotADiffusersPipeline, match="not a pipeline class of the installed diffusers"):
        classify("MadeUpPipeline", {"transformer": object()}, {})


# ---- recording -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pixart_model():
    return Model.of(tiny_family_pipeline("pixart-sigma"))


def test_recorded_calls_give_the_denoisers_axes(pixart_model):
    found = pixart_model.family.signatures(pixart_model)
    assert set(found) == {"text_encoder", "transformer", "vae"}
    (transformer,) = found["transformer"]
    dims = {slot.tensor.name: slot.tensor.dims for slot in transformer.inputs}
    batch, channels, height, width = dims["hidden_states"]
    assert (batch.name, channels, height.name, width.name) == ("batch_x2_guided", 4, "height_div8", "width_div8")
    assert batch.min_scale == 1 and batch.scale == 2  # twice the images with guidance, once without
    assert dims["encoder_hidden_states"][1].name == "text_tokens"
    assert dims["encoder_hidden_states"][1].bounds == (1, 300)  # PixArt-Σ's max_sequence_length
    assert transformer.outputs[0].tensor.dims[2].name == "height_div8"
    (decoder,) = found["vae"]
    assert decoder.component == "vae_decoder" and decoder.method == "decode"
    assert "generator" not in {decoder.paths[i] for i, _ in decoder.constants}  # passed along, not computed with


def test_a_recording_is_kept_in_the_cache_so_another_process_runs_no_pipeline(tmp_path, monkeypatch):
    first = Model.of(tiny_family_pipeline("pixart-sigma")).remember_digests_under(tmp_path)
    recorded = first.family.signatures(first)
    runs = []
    original = GenericFamily._recorded_call
    monkeypatch.setattr(GenericFamily, "_recorded_call",
                        lambda self, *a, **k: runs.append(a) or original(self, *a, **k))
    # a new Model of the same pipeline, as another process has it: its recording is read, the pipeline not run
    again = Model.of(tiny_family_pipeline("pixart-sigma")).remember_digests_under(tmp_path)
    assert again.family.signatures(again) == recorded and runs == []
    assert [e.component for e in kasoku.Cache(tmp_path).list()] == ["recording"]
    # a folder loaded lazily: the recording drops the weights it read, and a warm start (its modules never loaded,
    # their configs without the folder's name) finds what the cold one kept
    folder, saved = tmp_path / "pixart", tiny_family_pipeline("pixart-sigma")
    with torch.no_grad():
        saved.transformer.proj_out.weight.mul_(3)  # weights of its own: not the pipeline recorded above
    saved.save_pretrained(folder)
    cold = Model.load(folder, lazy=True).remember_digests_under(tmp_path)
    runs.clear()
    cold.family.signatures(cold)
    assert runs and not any(cold.is_loaded(name) for name in cold.family.modules(cold))
    runs.clear()
    warm = Model.load(folder, lazy=True).remember_digests_under(tmp_path)
    txt2img = ("txt2img",)
    warm.family.recordings_at(warm, warm.family.optimum_probe(_profile(warm.pipe)), txt2img)  # (recorded by neither)
    cold.family.recordings_at(cold, cold.family.optimum_probe(_profile(cold.pipe)), txt2img)
    assert warm.family.signatures(warm) == cold.family.signatures(cold)
    assert len(runs) == 2  # the optimum's two prompts, once: the second model read the first one's recording
    # other weights, or a scheduler set otherwise, are another recording
    changed = tiny_family_pipeline("pixart-sigma")
    with torch.no_grad():
        changed.transformer.proj_out.weight.mul_(2)
    model = Model.of(changed).remember_digests_under(tmp_path)
    model.family.signatures(model)
    assert runs, "changed weights were served another pipeline's recording"
    runs.clear()
    shifted = tiny_family_pipeline("pixart-sigma")
    shifted.register_modules(scheduler=type(shifted.scheduler).from_config(shifted.scheduler.config,
                                                                               num_train_timesteps=500))
    model = Model.of(shifted).remember_digests_under(tmp_path)
    model.family.signatures(model)
    assert runs and len([e for e in kasoku.Cache(tmp_path).list() if e.component == "recording"]) == 5
    # the folder read in bf16 is called in bf16: a recording of its own, which a warm start finds (transformers
    # writes the dtype it read into a loaded module's config, not into the meta stand-in's)
    runs.clear()
    cold = Model.load(folder, lazy=True, torch_dtype=torch.bfloat16).remember_digests_under(tmp_path)
    cold.family.signatures(cold)  # (its modules read, recorded and released: their configs now say bfloat16)
    cold.family.recordings_at(cold, cold.family.optimum_probe(_profile(cold.pipe)), txt2img)
    assert runs
    runs.clear()
    warm = Model.load(folder, lazy=True, torch_dtype=torch.bfloat16).remember_digests_under(tmp_path)
    warm.family.recordings_at(warm, warm.family.optimum_probe(_profile(warm.pipe)), txt2img)
    assert warm.family.signatures(warm) == cold.family.signatures(cold)
    assert not runs, [a[1:3] for a in runs]


def test_a_size_the_pipeline_refuses_raises_the_step():
    pipe = tiny_family_pipeline("sana")
    assert pipe.vae_scale_factor * 2 == 4 and _multiple(pipe) == 32  # Sana asks for multiples of 32


def test_the_denoiser_is_calibrated_on_calls_its_pipeline_takes():
    """int8 quantizes a recorded denoiser's activations too, calibrated on its pipeline's own calls: Sana Sprint's
    two steps (SCM refuses others) at its embedded guidance; PixArt-Σ's at most 8 of its 20, its guidance doubling
    the batch (the plan's own scale then). Every other graph's int8 is weights only."""
    sprint = Model.of(tiny_family_pipeline("sana-sprint"))
    specs = sprint.specs(_profile(sprint.pipe), None)
    assert (specs["transformer"].int8, dict(specs["transformer"].calibration)) == ("full", {"steps": 2,
                                                                                            "guidance": 4.5})
    assert {specs[name].int8 for name in specs if name != "transformer"} == {"weights"}
    pixart = Model.of(tiny_family_pipeline("pixart-sigma"))
    transformer = pixart.specs(_profile(pixart.pipe), ["transformer"])["transformer"]
    assert (transformer.int8, dict(transformer.calibration)) == ("full", {"steps": 8})
    assert pixart.fixed_arguments(_profile(pixart.pipe)) == {"use_resolution_binning": False}


def test_a_bf16_denoiser_whose_calibration_does_not_fit_gets_int8_weights_and_says_why(monkeypatch):
    """NNCF calibrates on an fp32 model: a denoiser read in bf16 whose calibration would not fit in this machine's
    memory (a 4B transformer, 7.3 GiB in bf16, on 24 GiB) is quantized weight-only, and the compile report says why;
    one that fits, or one read in fp32, is calibrated."""
    from kasoku.architectures.recorded import int8_recipe
    from kasoku.core import memory
    from kasoku.core.components import Precision
    from kasoku.core.options import CompileOptions
    from kasoku.pipeline.compiling import precision_notes

    monkeypatch.setattr(memory, "machine_memory", lambda: 24 * memory.GIB)
    def large(dtype):  # 8 GiB of weights in bf16
        return torch.nn.Linear(64 * 1024, 64 * 1024, device="meta", dtype=dtype)

    assert int8_recipe(large(torch.float32), calibrated=True) == {"int8": "full"}
    assert int8_recipe(torch.nn.Linear(8, 8).bfloat16(), calibrated=True) == {"int8": "full"}
    assert int8_recipe(large(torch.bfloat16), calibrated=False) == {"int8": "weights"}
    recipe = int8_recipe(large(torch.bfloat16), calibrated=True)
    assert recipe["int8"] == "weights" and "8.0 GiB of bf16 weights would hold about 40 GiB" in recipe["int8_note"]

    pixart = Model.of(tiny_family_pipeline("pixart-sigma").to(torch.bfloat16))
    monkeypatch.setattr(memory, "machine_memory", lambda: memory.GIB)  # less than the floor: nothing fits
    spec = pixart.specs(_profile(pixart.pipe), ["transformer"])["transformer"]
    assert spec.int8 == "weights"
    notes = precision_notes({"transformer": spec}, CompileOptions(precision=Precision.INT8))
    assert notes == [f"transformer: {spec.int8_note}."]
    assert precision_notes({"transformer": spec}, CompileOptions(precision=Precision.BF16)) == []


def test_only_the_outputs_the_pipeline_reads_are_compiled():
    model = Model.of(tiny_family_pipeline("flux2-klein"))
    (encoder,) = model.family.signatures(model)["text_encoder"]
    recorded = model.memo["recordings"][0].calls[0]
    assert recorded.component == "text_encoder" and len(recorded.output_leaves) > 28  # logits and 29 hidden states
    assert [o.tensor.name for o in encoder.outputs] == ["hidden_states_9", "hidden_states_18", "hidden_states_27"]


def test_a_graph_the_tasks_call_with_more_tokens_per_image_spans_them_all():
    """Flux.2 klein's inpainting appends the reference image's tokens to the image's: one transformer graph whose
    token axis takes twice text-to-image's, fitted to the image size (a free axis was bounded by the probes' sizes
    and refused calls at full size, the int8 calibration's first)."""
    model = Model.of(tiny_family_pipeline("flux2-klein"))
    (transformer,) = model.family.signatures(model)["transformer"]
    axis = transformer.inputs[0].tensor.dynamic_axes[1]
    assert axis.dims == ("height", "width") and axis.scales == (axis.scale, 2 * axis.scale)
    profile = model.default_profile()
    spec = model.specs(profile, ["transformer"])["transformer"]
    _, span = spec.axes()[axis.name]
    least, most = profile.min.height * profile.min.width, profile.max.height * profile.max.width
    assert (span.min, span.max) == (least * axis.scale, 2 * most * axis.scale)


@pytest.mark.integration
def test_a_sequence_of_the_prompt_and_the_image_tokens_spans_the_profile(generic_cache):
    """Ideogram 4's transformer takes the prompt's tokens and the image's packed ones as one sequence: one axis, the
    text tokens plus a product of the image's size (a free axis in its place was bounded by the probes' small sizes:
    the tiny pipeline's 192x192 call, 2352 tokens, was refused), and a call at the profile's largest size runs and
    matches diffusers."""
    pipe = tiny_family_pipeline("ideogram4")
    model = Model.of(pipe)
    (transformer,) = model.family.signatures(model)["transformer"]
    (axis,) = {d for d in transformer.inputs[0].tensor.dims if isinstance(d, Axis) and d.text}
    assert transformer.inputs[0].tensor.name == "hidden_states"
    assert axis.dims == ("height", "width") and axis.text == (1, 48, model.family.max_tokens())
    profile = _profile(pipe, max_batch=1, largest=192)
    spec = model.specs(profile, ["transformer"])["transformer"]
    assert spec.axes()[axis.name][1].max == model.family.max_tokens() + 192 * 192 * axis.scale
    fast = kasoku.compile(pipe, "onnxruntime", profile=profile, cache_dir=generic_cache)
    call = _arguments(pipe, height=192, width=192, guidance_schedule=[4.0, 4.0])
    assert psnr(_images(pipe, **call), _images(fast, **call)) >= MIN_PSNR


def test_model_outputs_flatten_with_their_keys():
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

    output = AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(torch.zeros(1, 8, 2, 2)))
    leaves, _, paths = _flatten_with_paths((output, {"scale": 1.0}))
    assert paths == [("0", "latent_dist"), ("1", "scale")] and leaves[1] == 1.0


def test_a_constant_that_changes_between_calls_is_refused():
    model = Model.of(tiny_family_pipeline("pixart-sigma"))
    recordings = model.family.record(model)
    call = next(c for c in recordings[0].calls if c.component == "transformer")
    index = call.paths.index("return_dict")
    leaves = list(call.leaves)
    leaves[index] = True
    changed = type(call)(call.component, call.method, call.arguments, call.paths, tuple(leaves), call.output,
                         call.output_paths, call.output_leaves, call.read)
    recordings[0].calls.append(changed)
    with pytest.raises(kasoku.KasokuError, match="`return_dict` changing from call to call"):
        signatures(recordings, "transformer", max_tokens=300)


def test_a_mask_given_as_booleans_and_as_integers_is_two_graphs(pixart_model):
    recordings = [dataclasses.replace(r, calls=list(r.calls)) for r in pixart_model.family.record(pixart_model)]
    call = next(c for c in recordings[0].calls if c.component == "transformer")
    index = call.paths.index("encoder_attention_mask")
    leaves = list(call.leaves)
    leaves[index] = leaves[index].bool()
    recordings[0].calls.append(dataclasses.replace(call, leaves=tuple(leaves)))
    found = signatures(recordings, "transformer", max_tokens=300)
    masks = {s.component: s.inputs[[slot.index for slot in s.inputs].index(index)].tensor.dtype for s in found}
    assert masks == {"transformer": torch.int64, "transformer_2": torch.bool}
    integers, booleans = found
    # each graph refuses the other's call, in one line
    assert "is a tensor of torch.bool where the engine takes torch.int64" in integers.difference(leaves)
    assert booleans.difference(leaves) is None


# ---- compiled against diffusers ------------------------------------------------------------------------------


def _check_family(family: str, backend: str, cache) -> None:
    pipe, fast = compiled(family, backend, cache)
    report = fast.compile_report
    denoiser = "transformer" if "transformer" in report.backends else "unet"
    assert (report.backends[denoiser] == backend) == (family in DENOISER_ON_ENGINES), report.in_torch
    decoders = [name for name in report.backends if name.startswith("vae_decoder") or name.endswith("_decode")]
    assert family == "deepfloyd-if" or decoders and all(report.backends[name] == backend for name in decoders)
    if family in DENOISER_IN_TORCH:
        assert report.in_torch.get(denoiser), "a component kept in torch says why"
        assert any(note.startswith(f"{denoiser} stays in torch: ") for note in report.notes)
    blocks = {name: ran for name, ran in report.backends.items() if name.startswith(f"{denoiser}.")}
    assert (bool(blocks) and set(blocks.values()) == {backend}) == (family in BLOCKS_ON_ENGINES), blocks
    guidance = [None] if "guidance_scale" not in inspect.signature(type(pipe).__call__).parameters or \
        family == "sana-sprint" else [True, False]
    for guided in guidance:
        call = _arguments(pipe, guided=guided)
        assert psnr(_images(pipe, **call), _images(fast, **call)) >= MIN_PSNR, (family, guided)


@pytest.mark.integration
@pytest.mark.parametrize("family", FAST)
def test_a_tiny_family_matches_diffusers_on_onnxruntime(family, generic_cache):
    _check_family(family, "onnxruntime", generic_cache)


@pytest.mark.integration
def test_a_tiny_family_matches_diffusers_on_openvino(generic_cache):
    _check_family("pixart-sigma", "openvino", generic_cache)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_tiny_family_matches_diffusers(family, backend, generic_cache):
    _check_family(family, backend, generic_cache)


@pytest.mark.integration
def test_a_pipeline_that_fails_when_recorded_is_refused_in_one_line(generic_cache):
    from kasoku.families.generic import NotCompilable

    pipe = tiny_family_pipeline("pixart-sigma")
    pipe.transformer.caption_projection.linear_1 = torch.nn.Linear(7, 8)  # takes no text encoder's states
    with pytest.raises(NotCompilable, match=r"PixArtSigma: its txt2img pipeline \(PixArtSigmaPipeline\) failed when "
                                            r"kasoku ran it to record its calls \(1 image\(s\) of 64x48\): "
                                            r"RuntimeError: mat1 and mat2") as error:
        kasoku.compile(pipe, "onnxruntime", profile=_profile(pipe), cache_dir=generic_cache)
    assert "\n" not in str(error.value)


@pytest.mark.integration
def test_a_pipeline_that_fails_in_diffusers_for_several_images_compiles_for_one():
    from kasoku.core.components import InvalidProfile

    model = Model.of(tiny_family_pipeline("prx"))  # PRX with guidance fails in diffusers for two prompts
    assert model.default_profile().max.batch == 1
    with pytest.raises(InvalidProfile, match=r"PRX makes one image per call: its pipeline fails in diffusers for 2 "
                                             r"images per call \(RuntimeError: The size of tensor a") as error:
        model.specs(_profile(model.pipe, max_batch=2))
    assert "\n" not in str(error.value)


@pytest.mark.integration
def test_img2img_runs_the_recorded_vae_encoder(generic_cache):
    from diffusers import ChromaImg2ImgPipeline
    from PIL import Image

    pipe, fast = compiled("chroma", "onnxruntime", generic_cache)
    assert fast.compile_report.backends["vae_encoder"] == "onnxruntime"
    image = Image.fromarray((np.indices((64, 64)).sum(0) % 255).astype(np.uint8)).convert("RGB")
    reference = ChromaImg2ImgPipeline(**pipe.components)
    call = _arguments(reference, image=image, strength=0.6)
    assert psnr(_images(reference, **call), _images(fast, **call)) >= MIN_PSNR


@pytest.mark.integration
def test_a_transformer_whose_dynamic_graph_fails_runs_engines_of_one_shape_built_per_call_shape(generic_cache):
    pipe, fast = compiled("chroma", "onnxruntime", generic_cache)
    report = fast.compile_report
    assert report.backends["transformer"] == "onnxruntime" and not report.in_torch
    (note,) = [n for n in report.notes if n.startswith("transformer runs engines of one shape")]
    # why: its dynamic graph failed its parity run at batch 1 (the export keeps the traced batch in places)
    assert "Got invalid dimensions for output" in note
    stand_in = fast._pipes["txt2img"].transformer
    assert not stand_in._at_shape
    call = _arguments(pipe, height=64, width=128)  # not the compiled shape: its engine is built on this call
    assert psnr(_images(pipe, **call), _images(fast, **call)) >= MIN_PSNR
    ((key, _),) = stand_in._at_shape.items()
    assert any(shape[:2] == (1, 32) for shape in key[1][0])  # its own engine: 4x8 latent patches, not 4x4


@pytest.mark.integration
def test_a_failed_export_is_remembered_and_a_warm_compile_exports_nothing(generic_cache, monkeypatch):
    from kasoku.build import compiler

    pipe, first = compiled("chroma", "onnxruntime", generic_cache)
    failed = json.loads((generic_cache / "failed-exports.json").read_text())
    assert any(f["message"].startswith("exporting transformer with the dynamo exporter") for f in failed.values())

    def exported(spec, *args, **kwargs):
        raise AssertionError(f"{spec.name} was exported again")

    monkeypatch.setattr(compiler, "export_graph", exported)
    again = kasoku.compile(tiny_family_pipeline("chroma"), "onnxruntime", profile=_profile(pipe),
                           cache_dir=generic_cache)
    assert again.compile_report.backends == first.compile_report.backends
    assert again.compile_report.notes == first.compile_report.notes


@pytest.fixture(scope="module")
def qwen_model():
    """Qwen-Image's tiny pipeline, recorded (its components' specs need no export)."""
    return Model.of(tiny_family_pipeline("qwen-image"))


@pytest.mark.integration
def test_a_graph_whose_text_follows_the_prompt_is_a_graph_of_one_shape_per_call(qwen_model):
    dynamic = qwen_model.family.signatures(qwen_model)["transformer"][0]
    assert dynamic.exact  # its call takes the image size as numbers (img_shapes): a graph of one image shape
    found = qwen_model.family.signature_at(qwen_model, dynamic, _profile(qwen_model.pipe))
    assert found.grows  # an engine per call shape, built on its first call
    text = {slot.tensor.name: slot.tensor.dims for slot in found.inputs}["encoder_hidden_states"]
    assert text[1].is_free  # as long as the prompt: two prompts recorded at one shape differ there
    assert all(isinstance(d, int) for slot in found.at_call().inputs for d in slot.tensor.dims)
    # text-to-image's graph of one shape is found in text-to-image's calls: the other tasks' pipelines are not run
    # at the optimum for it (at full size, minutes of a cold start)
    assert {tasks for _probe, tasks in qwen_model.memo["recordings_at"]} == {("txt2img",)}


@pytest.mark.integration
def test_a_graph_of_one_shape_whose_call_holds_its_size_is_built_per_size(generic_cache):
    """Qwen-Image's transformer takes the image's size as Python numbers (`img_shapes`): its graphs are of one shape,
    and a call at another size than the compiled one builds its own engine and matches diffusers (it was refused:
    the numbers, seen at one size, were taken for constants)."""
    pipe, fast = compiled("qwen-image", "onnxruntime", generic_cache)
    for size in (_profile(pipe).min.height, _profile(pipe).opt.height):  # the next test calls the latter too
        call = _arguments(pipe, height=size, width=size)
        assert psnr(_images(pipe, **call), _images(fast, **call)) >= MIN_PSNR, size
    sizes = {key[1] for _, key in fast._pipes["txt2img"].transformer._at_shape}  # the size-following values
    assert len(sizes) >= 2  # an engine per size


@pytest.mark.integration
def test_an_engine_per_prompt_length_is_built_on_the_first_call_of_each_length(generic_cache):
    pipe, fast = compiled("qwen-image", "onnxruntime", generic_cache)
    report = fast.compile_report
    assert report.backends["transformer"] == "onnxruntime" and "transformer" not in report.in_torch
    assert any(n.startswith("transformer runs engines of one shape") for n in report.notes), report.notes
    stand_in = fast._pipes["txt2img"].transformer
    engines = []
    for prompt in ("a red fox", "a red fox in the snow at night, lit by a lantern", "a red fox"):
        call = _arguments(pipe, prompt=prompt, negative_prompt="blurry")  # true CFG: both prompts, both lengths
        assert psnr(_images(pipe, **call), _images(fast, **call)) >= MIN_PSNR, prompt
        engines.append(dict(stand_in._at_shape))
    assert len(engines[1]) > len(engines[0])  # the longer prompt's engine was built when it was first called
    assert engines[2] == engines[1]  # and the first prompt's is served again, nothing built


@pytest.mark.integration
def test_inpaint_matches_diffusers(generic_cache):
    from diffusers import ChromaInpaintPipeline
    from PIL import Image

    pipe, fast = compiled("chroma", "onnxruntime", generic_cache)
    image = Image.fromarray((np.indices((64, 64)).sum(0) * 2 % 255).astype(np.uint8)).convert("RGB")
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    reference = ChromaInpaintPipeline(**pipe.components)
    call = _arguments(reference, image=image, mask_image=Image.fromarray(mask), strength=1.0)
    assert psnr(_images(reference, **call), _images(fast, **call)) >= MIN_PSNR


@pytest.mark.integration
def test_inpainting_and_text_to_image_share_one_graph_across_the_profile(generic_cache):
    """Flux.2 klein's transformer takes twice the tokens when inpainting: both tasks run on its one engine at the
    profile's largest size, as diffusers computes them."""
    from diffusers import Flux2KleinInpaintPipeline
    from PIL import Image

    pipe, fast = compiled("flux2-klein", "onnxruntime", generic_cache)
    size = _profile(pipe).max.height
    call = {**_arguments(pipe), "height": size, "width": size}
    assert psnr(_images(pipe, **call), _images(fast, **call)) >= MIN_PSNR
    image = Image.fromarray((np.indices((size, size)).sum(0) * 2 % 255).astype(np.uint8)).convert("RGB")
    mask = np.zeros((size, size), np.uint8)
    mask[size // 4:-size // 4, size // 4:-size // 4] = 255
    reference = Flux2KleinInpaintPipeline(**pipe.components)
    call = _arguments(reference, image=image, mask_image=Image.fromarray(mask), strength=1.0, height=size, width=size)
    assert psnr(_images(reference, **call), _images(fast, **call)) >= MIN_PSNR


@pytest.mark.integration
def test_a_call_unlike_the_recorded_ones_is_refused_in_one_line(generic_cache):
    _, fast = compiled("pixart-sigma", "onnxruntime", generic_cache)
    transformer = fast._pipes["txt2img"].transformer
    latents = torch.zeros(2, 4, 8, 8)
    with pytest.raises(InvalidInput, match="cannot serve this call: `return_dict` is True but was False"):
        transformer(latents, encoder_hidden_states=torch.zeros(2, 48, 32), timestep=torch.zeros(2),
                    encoder_attention_mask=torch.ones(2, 48, dtype=torch.int64), added_cond_kwargs={
                        "resolution": None, "aspect_ratio": None}, return_dict=True)
    # a prompt longer than compiled: not a matter of image size, and the message does not send the user there
    encoder = fast.engines["text_encoder"]
    (_, span), = (axis for axis in encoder.spec.axes().values() if axis[0].is_free)
    longer = {t.name: torch.ones((1, span.max + 1), dtype=torch.int64) for t in encoder.spec.inputs}
    with pytest.raises(ShapeOutOfProfile, match=rf"is {span.max + 1}, outside the engine's 1\.\.{span.max}: a length "
                                                rf"no image size gives .*Call it with at most {span.max}\.$"):
        encoder.run(longer)
    # an image where the model has no image-to-image class: one line, not a KeyError from deep inside
    with pytest.raises(InvalidInput, match="PixArtSigma has no img2img pipeline in diffusers"):
        fast(prompt="a red fox", image=np.zeros((64, 64, 3), np.uint8))


def test_a_pipeline_with_no_torch_component_is_refused_first():
    from kasoku.families.generic import NotCompilable

    with pytest.raises(NotCompilable, match="has no torch components to compile"):
        classify("PixArtSigmaPipeline", {"transformer": None, "vae": None}, {}, where="this folder")


@pytest.mark.integration
def test_a_call_outside_the_compiled_shapes_is_refused_before_it_runs(generic_cache):
    pipe, fast = compiled("pixart-sigma", "onnxruntime", generic_cache)
    with pytest.raises(kasoku.KasokuError, match="outside") as error:
        fast(**_arguments(pipe, height=256, width=256))
    assert "\n" not in str(error.value)


@pytest.mark.integration
def test_a_component_that_does_not_export_stays_in_torch_in_one_line_and_its_blocks_run_on_engines(generic_cache):
    pipe, fast = compiled("lumina2", "onnxruntime", generic_cache)
    reason = fast.compile_report.in_torch["transformer"]
    assert "\n" not in reason and len(reason) <= 200
    assert fast.compile_report.backends["vae_decoder"] == "onnxruntime"
    (note,) = [n for n in fast.compile_report.notes if n.startswith("transformer stays in torch: ")]
    # its data-dependent glue (caption lengths read with .tolist()) stays in torch, its six blocks do not
    assert note.endswith("; 6 of its 6 blocks run on engines"), note
    transformer = fast._pipes["txt2img"].transformer
    assert transformer is not pipe.transformer and pipe.transformer.layers[0].__class__.__name__ == \
        "Lumina2TransformerBlock"  # a copy runs the engines; the pipeline's own module is left as it is
    fast.times.reset()
    fast(**_arguments(pipe))
    assert fast.times.calls["transformer.layers.0"] > 0 and fast.times.calls["transformer.noise_refiner.1"] > 0


# ---- step caching ---------------------------------------------------------------------------------------------

CACHED_STEPS = 8  # warm-up 3, then one step in 2 computed: steps 0, 1, 2, 4, 6; 3, 5, 7 forecast


def _computed_steps(interval: int, warmup: int = 3) -> int:
    return sum(s < warmup or (s - warmup - 1) % interval == 0 for s in range(CACHED_STEPS))


@pytest.mark.integration
@pytest.mark.parametrize("interval,order", [(2, 1), (3, 2)])
def test_taylorseer_on_a_new_family_is_diffusers_taylorseer(interval, order, generic_cache):
    """`cache_interval` on a recorded transformer forecasts its output as diffusers' TaylorSeerCacheConfig forecasts
    the output projection (lite mode; factors in fp32): the same steps computed, the same image."""
    from diffusers import TaylorSeerCacheConfig
    from diffusers.hooks import apply_taylorseer_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    pipe, fast = compiled("pixart-sigma", "onnxruntime", generic_cache)
    call = _arguments(pipe, num_inference_steps=CACHED_STEPS)
    reference = tiny_family_pipeline("pixart-sigma")
    apply_taylorseer_cache(reference.transformer, TaylorSeerCacheConfig(
        cache_interval=interval, max_order=order, taylor_factors_dtype=torch.float32, cache_identifiers=["^proj_out$"]))
    _set_cache_context(reference.transformer, CacheContext("cond"))  # PixArt's pipeline names none
    fast.times.reset()
    images = _images(fast, cache_interval=interval, cache_order=order, **call)
    assert fast.times.calls["transformer"] == _computed_steps(interval) == CACHED_STEPS - fast.last_step_cache.forecasts
    assert psnr(_images(reference, **call), images) >= MIN_PSNR  # measured 138 dB
    assert psnr(_images(fast, **call), images) < 100  # and the forecast is not the computed image


@pytest.mark.integration
@pytest.mark.parametrize("family,component", [("chroma", "transformer"), ("lumina2", "transformer.layers.0")])
def test_taylorseer_keeps_a_forecast_per_call_of_a_step(family, component, generic_cache):
    """Chroma and Lumina 2 run guidance as two transformer calls a step without naming them to diffusers' hooks:
    each keeps its own forecast (both calls compute the same steps). On Lumina 2 the blocks' engines are skipped."""
    pipe, fast = compiled(family, "onnxruntime", generic_cache)
    call = _arguments(pipe, guided=True, num_inference_steps=CACHED_STEPS)
    plain = _images(fast, **call)
    fast.times.reset()
    images = _images(fast, cache_interval=2, **call)
    assert fast.times.calls[component] == 2 * _computed_steps(2)
    assert fast.last_step_cache.forecasts == 2 * (CACHED_STEPS - _computed_steps(2))
    assert 25.0 <= psnr(plain, images) < 100  # tiny random weights, 8 steps: measured 39 and 30 dB


@pytest.mark.integration
@pytest.mark.parametrize("threshold", [0.0, 0.2, 1.0])
def test_first_block_cache_on_a_new_family_is_diffusers_first_block_cache(threshold, generic_cache):
    """`cache_threshold` on a recorded transformer builds its blocks' engines on the first cached call and runs
    diffusers' first-block cache over them: the same steps skipped as diffusers' FirstBlockCacheConfig on its torch
    module, the same image."""
    from diffusers import FirstBlockCacheConfig
    from diffusers.hooks import apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    pipe, fast = compiled("pixart-sigma", "onnxruntime", generic_cache)
    call = _arguments(pipe, guided=True, num_inference_steps=CACHED_STEPS)
    reference = tiny_family_pipeline("pixart-sigma")
    apply_first_block_cache(reference.transformer, FirstBlockCacheConfig(threshold=threshold))
    _set_cache_context(reference.transformer, CacheContext("cond"))
    fast.times.reset()
    images = _images(fast, cache_threshold=threshold, **call)
    run = fast.last_step_cache
    skipped = sum(change <= threshold for change in run.changes)
    assert len(run.changes) == CACHED_STEPS and run.changes[0] == float("inf") and run.skipped == skipped
    assert (threshold == 0.0) == (skipped == 0)
    calls = fast.times.calls
    assert "transformer" not in calls  # the blocks' engines ran, not the whole graph's
    assert calls["transformer.transformer_blocks.0"] == CACHED_STEPS
    assert calls["transformer.transformer_blocks.1"] == CACHED_STEPS - skipped
    assert psnr(_images(reference, **call), images) >= MIN_PSNR  # measured 140 dB


@pytest.mark.integration
def test_a_compile_with_step_cache_builds_the_blocks_first(generic_cache):
    """`step_cache=True` (`--step-cache`, what serve and batch pass) builds the blocks' engines with the rest, so that
    the first cached call builds nothing."""
    pipe = tiny_family_pipeline("pixart-sigma")
    fast = kasoku.compile(pipe, "onnxruntime", profile=_profile(pipe), cache_dir=generic_cache, step_cache=True)
    report = fast.compile_report
    assert report.backends["transformer"] == "onnxruntime"
    assert report.backends["transformer.transformer_blocks.1"] == "onnxruntime"
    stages = len(report.stages)
    fast(**_arguments(pipe), cache_threshold=0.1)
    assert len(fast.compile_report.stages) == stages


@pytest.mark.integration
def test_first_block_cache_on_blocks_already_on_engines_keeps_a_cache_per_call_of_a_step(generic_cache):
    """Lumina 2's blocks run on engines (its glue in torch) and its guidance is two calls a step: each has its own
    first step, its refiners run on every step, and only the `layers` after the first are skipped."""
    pipe, fast = compiled("lumina2", "onnxruntime", generic_cache)
    call = _arguments(pipe, guided=True, num_inference_steps=CACHED_STEPS)
    plain = _images(fast, **call)
    fast.times.reset()
    images = _images(fast, cache_threshold=1.0, **call)
    run, calls = fast.last_step_cache, fast.times.calls
    assert run.changes.count(float("inf")) == 2 and run.skipped > 0
    assert calls["transformer.noise_refiner.0"] == calls["transformer.layers.0"] == 2 * CACHED_STEPS
    assert calls["transformer.layers.1"] == 2 * CACHED_STEPS - run.skipped
    assert 15.0 <= psnr(plain, images) < 100  # threshold 1.0 skips nearly every step: measured 22 dB
    # the torch glue runs between the blocks' engines: their threads do not spin (measured 3x faster on 2 cores)
    options = fast.engines["transformer.layers.0"].session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert not fast.engines["vae_decoder"].spec.interleaved


@pytest.mark.integration
def test_a_first_block_cache_with_no_block_to_skip_is_refused_in_one_line(generic_cache):
    """Tiny Chroma has one double-stream block; its single-stream block works on the joined text and image tokens,
    so no block after the first hands on the first's image tokens."""
    pipe, fast = compiled("chroma", "onnxruntime", generic_cache)
    with pytest.raises(InvalidInput, match="found no block after the first") as error:
        fast(**_arguments(pipe), cache_threshold=0.1)
    assert "\n" not in str(error.value)


def test_a_first_block_cache_without_block_lists_is_refused_before_any_engine():
    from kasoku.core.step_cache import FIRST_BLOCK, StepCaching

    model = Model.of(tiny_family_pipeline("kandinsky3"))  # a U-Net: its up blocks are no transformer blocks
    with pytest.raises(InvalidInput, match="has 0 block"):
        model.family.step_cache_graphs(model, StepCaching(method=FIRST_BLOCK))

def _check_precision(family: str, precision: str, cache) -> None:
    """bf16 and int8 (weights) on OpenVINO, against the fp32 engines within kasoku's contract for them."""
    from kasoku.core.components import Precision
    from kasoku.core.parity import TOLERANCES, ssim

    pipe, fp32 = compiled(family, "openvino", cache)
    contract = TOLERANCES[Precision(precision)]
    low = kasoku.compile(pipe, "openvino", precision=precision, profile=_profile(pipe), cache_dir=cache)
    assert set(low.compile_report.precisions.values()) == {precision} and not low.compile_report.in_torch
    call = _arguments(pipe, num_inference_steps=contract.image_steps)
    expected, actual = _images(fp32, **call), _images(low, **call)
    assert psnr(expected, actual) >= contract.image_psnr_db and ssim(expected, actual) >= contract.image_ssim


@pytest.mark.integration
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_reduced_precisions_keep_their_contract(precision, generic_cache):
    _check_precision("pixart-sigma", precision, generic_cache)


@pytest.mark.integration
def test_a_decoder_with_int8_activations_is_calibrated_on_the_images_it_decodes(generic_cache):
    """Sana Sprint's DC-AE decoder with `int8_activations`: calibrated on its own calls in the pipeline's runs (the
    denoiser's steps, the latents decoded), its convolutions computing in int8 where plain int8 leaves them in
    floating point, proven against torch, and the image within int8's contract from diffusers' fp32 one."""
    from kasoku.core.parity import TOLERANCES, Precision
    from kasoku.policies.calibration import CALIBRATION_RUNS
    from kasoku.tools.verification import verify
    from tests.conftest import layer_precisions

    pipe = tiny_family_pipeline("sana-sprint")
    fast = kasoku.compile(pipe, "openvino", precision="int8", int8_activations=["vae_decoder"], profile=_profile(pipe),
                          cache_dir=generic_cache)
    stages = {(s.component, s.stage): s for s in fast.compile_report.stages}
    assert stages["vae_decoder", "calibrate"].detail == {"samples": CALIBRATION_RUNS}
    assert stages["vae_decoder", "engine"].detail["int8"] == {"recipe": "full", "calibration_samples": CALIBRATION_RUNS}
    assert stages["vae_decoder", "engine"].detail["parity"]  # proven against torch when built
    assert {"u8", "i8"} & set(layer_precisions(fast.engines["vae_decoder"], "Convolution"))
    weights_only = kasoku.compile(pipe, "openvino", precision="int8", profile=_profile(pipe), cache_dir=generic_cache)
    assert not {"u8", "i8"} & set(layer_precisions(weights_only.engines["vae_decoder"], "Convolution"))
    assert weights_only.compile_report.statuses()["transformer", "engine"] == "reused"  # the same int8 denoiser
    call = _arguments(pipe)
    assert psnr(_images(pipe, **call), _images(fast, **call)) >= TOLERANCES[Precision.INT8].image_psnr_db
    # verify holds the images to the contract against fp32 engines (which take no int8 activations), at Sana
    # Sprint's own 2 steps: its SCM scheduler takes no other count, where the contract's are 20
    report = verify(pipe, "openvino", precision="int8", int8_activations=["vae_decoder"], profile=_profile(pipe),
                    cache_dir=generic_cache)
    assert report.image.shape.endswith(", 2 steps, 3 prompt(s)") and report.passed, report.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("family", ["flux2-klein", "cogview4"])
def test_reduced_precisions_keep_their_contract_on_more_families(family, precision, generic_cache):
    _check_precision(family, precision, generic_cache)


@pytest.mark.integration
def test_a_pipeline_read_in_bf16_builds_bf16_graphs_and_is_left_in_bf16(generic_cache, tmp_path, monkeypatch):
    """A generic pipeline in bf16 (a live one, and a folder read with diffusers' `torch_dtype`) compiles bf16 graphs:
    the weights, the engines' inputs and outputs and their compute in bf16 (half the memory of fp32 at full size),
    images as close to diffusers' own bf16 pipeline as bf16 engines are to fp32; fp32 asked of it builds bf16 and
    says why; int8 is quantized from the bf16 weights (the transformer calibrated on its bf16 calls) within int8's
    contract; a backend without bf16 is refused before a graph is built; the user's pipeline stays in bf16. int4
    weights asked for a recorded text encoder whose engine misses the contract are refused with the remedy (a
    recorded component does not stay in torch for a quantization the user named)."""
    from kasoku.core.options import InvalidOptions
    from kasoku.core.parity import TOLERANCES, Precision
    from tests.conftest import linear_layer_precisions

    pipe = tiny_family_pipeline("pixart-sigma").to(torch.bfloat16)
    cache = generic_cache / "bf16"
    fast = kasoku.compile(pipe, "openvino", profile=_profile(pipe), cache_dir=cache)
    report = fast.compile_report
    assert set(report.precisions.values()) == {"bf16"} and set(report.backends.values()) == {"openvino"}
    assert any("its weights were read in bfloat16, so its engine computes in bf16 (asked: fp32)" in note
               for note in report.notes)
    assert {module.dtype for module in (pipe.transformer, pipe.text_encoder, pipe.vae)} == {torch.bfloat16}
    text = fast.engines["text_encoder"].spec  # token ids in: only `in_bf16` tells its graph from the fp32 one
    assert text.in_bf16 and dataclasses.replace(text, in_bf16=False).architecture != text.architecture
    engine = fast.engines["transformer"]
    out = engine.run(engine.spec.sample_inputs(engine.spec.profile.opt))
    assert {tensor.dtype for tensor in out.values()} == {torch.bfloat16}
    call = _arguments(pipe)
    bound = TOLERANCES[Precision.BF16].image_psnr_db
    assert psnr(_images(pipe, **call).astype(np.float32), _images(fast, **call)) >= bound

    with pytest.raises(InvalidOptions, match="read in bfloat16.*onnxruntime backend cannot build bf16"):
        kasoku.compile(pipe, "onnxruntime", profile=_profile(pipe), cache_dir=cache)
    int8 = kasoku.compile(pipe, "openvino", precision="int8", profile=_profile(pipe), cache_dir=cache)
    assert set(int8.compile_report.precisions.values()) == {"int8"}
    stages = int8.compile_report.stages
    entry = next(s for s in stages if s.component == "transformer" and s.stage == "engine")
    assert entry.detail["int8"]["recipe"] == "full" and entry.detail["int8"]["calibration_samples"] > 0
    engine = int8.engines["transformer"]  # calibrated on bf16 calls, quantized from its bf16 weights
    assert {"u8", "i8"} & set(linear_layer_precisions(engine))  # its linear layers compute in int8
    assert "u8" in linear_layer_precisions(int8.engines["text_encoder"])  # int8 weights in OpenVINO's linear layers
    out = engine.run(engine.spec.sample_inputs(engine.spec.profile.opt))
    assert {tensor.dtype for tensor in out.values()} == {torch.bfloat16}
    assert {module.dtype for module in (pipe.transformer, pipe.text_encoder, pipe.vae)} == {torch.bfloat16}
    contract = TOLERANCES[Precision.INT8]
    call = _arguments(pipe, num_inference_steps=contract.image_steps)
    assert psnr(_images(pipe, **call).astype(np.float32), _images(int8, **call)) >= contract.image_psnr_db
    from kasoku.core.parity import QuantizationMissed

    strict = {**TOLERANCES, Precision.INT8: dataclasses.replace(contract, rel_error=1e-4)}
    monkeypatch.setattr("kasoku.core.parity.TOLERANCES", strict)
    with pytest.raises(QuantizationMissed, match=r"(?s)text_encoder with int4 weights misses.*out of `int4_weights`"):
        kasoku.compile(pipe, "openvino", precision="int8", int4_weights=["text_encoder"], profile=_profile(pipe),
                       cache_dir=cache)
    monkeypatch.undo()

    folder = tmp_path / "pixart"
    tiny_family_pipeline("pixart-sigma").save_pretrained(folder)
    read = kasoku.KasokuPipeline.from_pretrained(folder, "openvino", torch_dtype=torch.bfloat16,
                                                 profile=_profile(pipe), cache_dir=cache)
    assert set(read.compile_report.precisions.values()) == {"bf16"}
    assert all(read.model.in_bf16(name) for name in ("text_encoder", "transformer", "vae"))
    own = type(pipe).from_pretrained(folder, torch_dtype=torch.bfloat16)  # T5 keeps its `wo` layers in fp32
    assert psnr(_images(own, **call).astype(np.float32), _images(read, **call)) >= bound


# ---- LoRA through the class's own diffusers loader ---------------------------------------------------------


def _two_adapters(pipe, folder) -> tuple[str, str]:
    from tests.conftest import save_transformer_adapter

    return (str(save_transformer_adapter(pipe, folder / "a", 1, ["to_q", "to_k", "to_v", "to_out.0"])),
            str(save_transformer_adapter(pipe, folder / "b", 2, ["to_q", "to_v"])))


def _check_lora(reference, fast, folder) -> None:
    """One adapter, then two blended, against diffusers' own `load_lora_weights`; unloading gives the base back."""
    a, b = _two_adapters(reference, folder)
    call = _arguments(reference)
    base = _images(fast, **call)
    for pipe in (reference, fast):
        pipe.load_lora_weights(a, adapter_name="a")
    one = _images(fast, **call)
    assert psnr(_images(reference, **call), one) >= MIN_PSNR and psnr(base, one) < 70  # it changes the image
    for pipe in (reference, fast):
        pipe.load_lora_weights(b, adapter_name="b")
        pipe.set_adapters(["a", "b"], [0.7, 0.5])
    assert psnr(_images(reference, **call), _images(fast, **call)) >= MIN_PSNR
    fast.unload_lora_weights()
    assert np.array_equal(_images(fast, **call), base)  # the base weights exactly


@pytest.mark.integration
def test_lora_one_adapter_and_two_blended_on_a_new_family(generic_cache, tmp_path):
    _, fast = compiled("chroma", "onnxruntime", generic_cache)  # its transformer: an engine of one shape
    _check_lora(tiny_family_pipeline("chroma"), fast, tmp_path)


@pytest.mark.slow(reason="a second family's LoRA, with run-time weights")
def test_lora_with_run_time_weights_on_another_new_family(generic_cache, tmp_path):
    reference = tiny_family_pipeline("cogview4")
    fast = kasoku.compile(tiny_family_pipeline("cogview4"), "onnxruntime", profile=_profile(reference),
                          cache_dir=generic_cache, lora_targets="attention")
    assert fast.lora_components == ("transformer",)
    _check_lora(reference, fast, tmp_path)


@pytest.mark.integration
def test_lora_is_refused_where_diffusers_has_no_loader_or_the_module_is_several_graphs(generic_cache, qwen_model,
                                                                                      tmp_path):
    from kasoku.runtime.lora import LoraError

    pipe, pixart = compiled("pixart-sigma", "onnxruntime", generic_cache)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "pytorch_lora_weights.safetensors").write_bytes(b"")
    with pytest.raises(LoraError, match="PixArtSigmaPipeline has no LoRA loader in diffusers"):
        pixart.load_lora_weights(str(folder))
    a, _ = _two_adapters(qwen_model.pipe, tmp_path)
    with pytest.raises(kasoku.KasokuError, match=r"the transformer of this QwenImage pipeline runs as 3 graphs"):
        qwen_model.family.lora_state_dict(a, qwen_model)


# ---- kasoku's other tools on a new family's folder -------------------------------------------------------------


@pytest.fixture(scope="module")
def pixart_dir(tmp_path_factory):
    from kasoku.tools.tiny import write_tiny_pipeline

    return write_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny-pixart", family="pixart-sigma")


@pytest.mark.integration
def test_compile_with_shape_flags_records_the_pipeline_once(pixart_dir, generic_cache, monkeypatch):
    """`kasoku compile DIR --height ...` reads the default profile from the same Model it compiles: the recorded
    pipeline runs its probes once, not once for the profile and again for the compile."""
    from kasoku.cli import main

    recorded = []
    record = GenericFamily.record

    def counted(self, model):
        if "recordings" not in model.memo:
            recorded.append(model)
        return record(self, model)

    monkeypatch.setattr(GenericFamily, "record", counted)
    assert main(["compile", str(pixart_dir), "--backend", "onnxruntime", "--height", "64:128", "--width",
                 "64:128", "--batch", "1:2", "--cache-dir", str(generic_cache)]) == 0
    assert len(recorded) == 1


@pytest.mark.integration
def test_verify_and_batch_run_on_a_new_familys_folder(pixart_dir, generic_cache, tmp_path):
    import json

    from kasoku.cli import main
    from kasoku.tools.verification import verify

    pipe, _ = compiled("pixart-sigma", "onnxruntime", generic_cache)
    report = verify(pixart_dir, "onnxruntime", profile=_profile(pipe), cache_dir=generic_cache)
    assert report.passed and report.image.psnr_db >= MIN_PSNR, report.to_dict()
    assert {c.component for c in report.components} == {"text_encoder", "transformer", "vae_decoder"}
    jobs = tmp_path / "jobs.jsonl"  # no negative prompt: the pipeline's own default ("" for PixArt)
    jobs.write_text("".join(json.dumps({"prompt": p, "seed": s, "steps": 2, "height": 64, "width": 64}) + "\n"
                            for s, p in enumerate(["a red fox", "an old lighthouse"])))
    out = tmp_path / "out"
    assert main(["batch", str(pixart_dir), str(jobs), "--out", str(out), "--backend", "onnxruntime", "--height",
                 "32:128", "--width", "32:128", "--cache-dir", str(generic_cache)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["000001.png", "000002.png"]


@pytest.mark.slow(reason="starts a server for PixArt-Σ and builds its engines for the server's sizes; serve's own "
                         "tests run in make test")
def test_serve_answers_with_a_new_familys_images(pixart_dir, generic_cache, tmp_path):
    from tests.serve.test_serve import PROMPT, Server, pixels

    server = Server(tmp_path / "serve", pixart_dir, generic_cache, "--max-batch", "1", "--size", "64x64")
    try:
        answer = server.client(key=None).images.generate(prompt=PROMPT, n=1, size="64x64", response_format="b64_json",
                                                         extra_body={"seed": 3, "steps": 2, "guidance": 4.5})
        profile = ShapeProfile.from_dict(server.ready()["profile"])
    finally:
        assert server.stop() == 0, server.output()
    reference = kasoku.KasokuPipeline.from_pretrained(pixart_dir, options=kasoku.CompileOptions(
        backend="onnxruntime", cache_dir=generic_cache, profile=profile))
    want = reference(PROMPT, generator=torch.Generator().manual_seed(3), num_inference_steps=2, guidance_scale=4.5,
                     height=64, width=64).images[0]
    assert pixels(answer.data[0].b64_json).tobytes() == np.asarray(want).tobytes()


@pytest.mark.slow(reason="compiles PixArt-Σ's three components with inductor (about 90 s on 2 cores)")
def test_inductor_compiles_a_new_family_from_its_recorded_calls(generic_cache):
    pipe = tiny_family_pipeline("pixart-sigma")
    fast = kasoku.compile(pipe, "inductor", profile=_profile(pipe), cache_dir=generic_cache)
    assert set(fast.compile_report.backends.values()) == {"inductor"}, fast.compile_report.backends
    for guided in (True, False):
        call = _arguments(pipe, guided=guided)
        assert psnr(_images(pipe, **call), _images(fast, **call)) >= MIN_PSNR, guided
