"""Drop-in for real: for every diffusers pipeline class kasoku compiles, the compiled pipeline takes that class's
own call arguments, with their names and meanings (`image` is the control image of diffusers' ControlNet
text-to-image pipelines), and gives the class's own image; the inputs diffusers takes (PIL, numpy, torch) work;
anything else is refused first. On the torch reference backend: no export, so every class is checked."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import kasoku
from kasoku.core.components import ImageShape, ShapeProfile
from kasoku.core.parity import psnr
from kasoku.families import FAMILIES, SUPPORTED_PIPELINES
from kasoku.pipeline.kasoku_pipeline import InvalidInput
from kasoku.policies.fidelity import seeded_call
from kasoku.tools.tiny import tiny_pipeline

PROFILE = ShapeProfile.from_ranges((1, 1, 2), (32, 64, 64), (32, 64, 64), 16)
KASOKU_ONLY = ("cache_interval", "cache_schedule", "cache_method", "cache_threshold", "cache_order", "cache_warmup")


def pipeline_of(class_name: str):
    """A tiny diffusers pipeline of this class (a ControlNet one with a tiny ControlNet, an LCM one with an
    LCM-distilled U-Net), and its task."""
    for family in FAMILIES.values():
        for group in family.pipeline_sets:
            for task, name in group.items():
                if name == class_name:
                    return family.task_pipeline(family.tiny_lcm_pipeline(), task), task, False
        for controlnet, classes in ((False, family.pipelines), (True, family.controlnet_pipelines)):
            for task, name in classes.items():
                if name == class_name:
                    base = tiny_pipeline(family=family.name)
                    if not controlnet:
                        return family.task_pipeline(base, task), task, False
                    net = family.tiny_controlnet()
                    pipe = family.pipeline_class(task, controlnet=True).from_pipe(base, controlnet=net)
                    pipe.set_progress_bar_config(disable=True)
                    return pipe, task, True
    raise AssertionError(f"no family has {class_name}")


def diffusers_arguments(task: str, controlnet: bool, parameters) -> dict:
    """A call of this task in diffusers' own names (the control image is `control_image`, or `image` in the U-Net
    families' text-to-image: where the class's `parameters` have no `control_image`)."""
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    control = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    arguments = {"txt2img": {}, "img2img": {"image": image, "strength": 0.7},
                 "inpaint": {"image": image, "mask_image": Image.fromarray(mask)}}[task]
    if controlnet:
        arguments["control_image" if "control_image" in parameters else "image"] = control
    return arguments


@pytest.mark.integration  # every supported class, each compiled on torch and run twice
@pytest.mark.parametrize("class_name", SUPPORTED_PIPELINES)
def test_every_class_takes_its_own_arguments_and_gives_its_own_image(class_name, tmp_path):
    pipe, task, controlnet = pipeline_of(class_name)
    fast = kasoku.compile(pipe, "torch", profile=PROFILE, cache_dir=tmp_path)
    theirs = inspect.signature(type(pipe).__call__).parameters
    ours = inspect.signature(fast).parameters
    names = [n for n, p in theirs.items() if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert [n for n in ours if n in names] == names  # every one of them, in their order
    assert all(ours[n].default == theirs[n].default for n in names)
    assert all(ours[name].kind is inspect.Parameter.KEYWORD_ONLY for name in KASOKU_ONLY)
    sized = {name: 64 for name in ("height", "width") if name in theirs}  # img2img takes its size from the image
    call = dict(num_inference_steps=2, output_type="np", **sized, **diffusers_arguments(task, controlnet, theirs))
    call.update(fast.fixed_arguments)
    # the same global generator too: SD3's ControlNet pipeline samples its control latents from it
    expected = seeded_call(pipe, "a photo of a cat", 0, **call).images
    actual = seeded_call(fast, "a photo of a cat", 0, **call).images
    assert psnr(expected, actual) >= 40


@pytest.fixture(scope="module")
def fast(tiny_pipe, tmp_path_factory):
    return kasoku.compile(tiny_pipe, "torch", profile=PROFILE, cache_dir=tmp_path_factory.mktemp("cache"))


def test_images_as_numpy_arrays_and_tensors_work_as_in_diffusers(fast, tiny_pipe):
    rng = np.random.default_rng(1)
    array = rng.random((64, 64, 3)).astype(np.float32)  # HWC in [0, 1], as diffusers' image processor reads
    tensor = torch.from_numpy(array).permute(2, 0, 1)[None] * 2 - 1  # NCHW in [-1, 1]
    from kasoku.families import FAMILIES

    img2img = FAMILIES["sd1"].task_pipeline(tiny_pipe, "img2img")
    for image in (array, tensor, [Image.fromarray((array * 255).astype(np.uint8))]):
        call = dict(image=image, strength=0.7, num_inference_steps=2, output_type="np")
        expected = img2img("a cat", generator=torch.Generator().manual_seed(0), **call).images
        assert psnr(expected, fast("a cat", generator=torch.Generator().manual_seed(0), **call).images) >= 40


@pytest.mark.parametrize("call, message", [
    (dict(num_inference_step=2), r"`num_inference_step` is not an argument of this pipeline \(diffusers' "
                                 r"StableDiffusionPipeline.*did you mean `num_inference_steps`"),
    (dict(strength=0.5), r"`strength` does not apply to txt2img \(StableDiffusionPipeline takes no `strength`\); "
                         r"give `image`"),
    (dict(image="in.png"), r"`image` must be a PIL image, a numpy array or a torch tensor .* but is a str \(a path: "
                           r"open it first"),
    (dict(width=100_000), r"`width` is 100000, more than this model serves: at most 4 x its native 64 = 256"),
    (dict(mask_image=np.zeros((64, 64))), r"inpainting needs `image` as well as `mask_image`"),
])
def test_what_diffusers_would_take_silently_or_fail_on_later_is_refused_first(fast, call, message):
    fast.times.reset()
    with pytest.raises(InvalidInput, match=message):
        fast("a cat", num_inference_steps=2, **call)
    assert not fast.times.calls  # nothing ran


def test_positional_arguments_bind_in_the_classes_own_order(fast):
    """StableDiffusionPipeline's order is (prompt, height, width, num_inference_steps, ...): so is ours."""
    named = fast("a cat", height=32, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                 output_type="np").images
    positional = fast("a cat", 32, 64, 2, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert positional.shape == (1, 32, 64, 3) and np.array_equal(named, positional)
    with pytest.raises(InvalidInput, match="`height` is given twice: by position and by name"):
        fast("a cat", 32, height=32)


def test_a_long_prompt_warns_that_it_is_cut(fast):
    with pytest.warns(UserWarning, match=r"the prompt is \d+ tokens for text_encoder, which reads the first 77"):
        fast("a photo of a cat " * 40, num_inference_steps=1, output_type="latent")


def _encoded_prompt(pipe, family: str, **arguments) -> dict[str, torch.Tensor]:
    """diffusers' own encode_prompt of "a cat" (and "blurry" as the negative prompt under guidance), by name."""
    if family == "flux":  # embedded guidance: no negative prompt
        embeds, pooled, _ = pipe.encode_prompt("a cat", prompt_2=None, device="cpu", num_images_per_prompt=1,
                                               **arguments)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    others = {"prompt_2": None, "prompt_3": None} if family == "sd3" else {}
    encoded = pipe.encode_prompt("a cat", **others, **arguments, device="cpu", num_images_per_prompt=1,
                                 do_classifier_free_guidance=True, negative_prompt="blurry")
    return dict(zip(names, encoded))


@pytest.mark.parametrize("family", ["sd1", "sd3"])
def test_prompt_embeddings_need_no_text_encoder_engines(family, tmp_path):
    """As in diffusers, a call that gives its prompt embeddings (the negative ones under guidance, the pooled ones
    where the pipeline takes them) encodes no prompt: engines compiled without the text encoders serve it."""
    pipe = tiny_pipeline(family=family)
    fast = kasoku.compile(pipe, "torch", components=("unet" if family == "sd1" else "transformer", "vae_decoder"),
                          cache_dir=tmp_path)
    embeds = _encoded_prompt(pipe, family, **(fast.fixed_arguments if family == "sd3" else {}))
    call = dict(num_inference_steps=2, output_type="np", height=64, width=64, **fast.fixed_arguments)
    expected = pipe(generator=torch.Generator().manual_seed(0), **embeds, **call).images
    actual = fast(generator=torch.Generator().manual_seed(0), **embeds, **call).images
    assert psnr(expected, actual) >= 40
    guided_without_negative = {name: value for name, value in embeds.items() if not name.startswith("negative")}
    with pytest.raises(InvalidInput, match="txt2img needs the text_encoder"):  # the negative prompt must be encoded
        fast(**guided_without_negative, **call)
    with pytest.raises(InvalidInput, match="txt2img needs the text_encoder"):
        fast("a cat", **call)
    with pytest.raises(InvalidInput, match="txt2img needs the text_encoder"):  # a text is encoded
        fast(**guided_without_negative, negative_prompt="blurry", **call)
    cut = {**embeds, "prompt_embeds": embeds["prompt_embeds"][:, :5]}
    with pytest.raises(InvalidInput, match=r"`prompt_embeds` holds 5 tokens but these engines read \d+"):
        fast(**cut, **call)


@pytest.mark.parametrize("family", ["sd1", "sdxl", "sd3", "flux"])
def test_a_pipeline_without_text_encoders_runs_on_prompt_embeddings(family, tmp_path):
    """diffusers loads a pipeline with `text_encoder=None, ...` (T5-XXL alone is 19 GB in fp32) and calls it with
    embeddings encoded elsewhere: so does kasoku, from its saved folder; a call with a prompt text is refused before
    anything runs, naming the embeddings to give."""
    pipe = tiny_pipeline(family=family)
    embeds = _encoded_prompt(pipe, family)
    bare = type(pipe)(**{name: None if name.startswith("text_encoder") else module
                         for name, module in pipe.components.items()})
    bare.save_pretrained(tmp_path / "bare")
    fast = kasoku.KasokuPipeline.from_pretrained(tmp_path / "bare", "torch", cache_dir=tmp_path / "cache",
                                                 profile=ShapeProfile.exact(ImageShape(1, 64, 64), None, 16))
    assert not any(name.startswith("text_encoder") for name in fast.engines)
    call = dict(num_inference_steps=2, output_type="np", height=64, width=64, **fast.fixed_arguments)
    expected = bare(generator=torch.Generator().manual_seed(0), **embeds, **call).images
    actual = fast(generator=torch.Generator().manual_seed(0), **embeds, **call).images
    assert psnr(expected, actual) >= 40
    fast.times.reset()
    with pytest.raises(InvalidInput, match=r"pipeline has no text encoders \(loaded with text_encoder=None\): give "
                                           r"`prompt_embeds`"):
        fast("a cat", **call)
    assert not fast.times.calls
    half = {name: value for name, value in embeds.items() if not name.startswith("negative")}
    if family != "flux":  # under guidance the negative embeddings are wanted too
        with pytest.raises(InvalidInput, match="`negative_prompt_embeds`"):
            fast(**half, **call)


def test_compile_refuses_what_is_not_a_live_pipeline(tiny_dir, tiny_pipe):
    with pytest.raises(kasoku.KasokuError, match=r"this is a NoneType \(not a pipeline\)"):
        kasoku.compile(None)
    with pytest.raises(kasoku.KasokuError) as refused:
        kasoku.compile(tiny_pipe.unet)
    assert len(str(refused.value)) < 400 and "one component of a pipeline" in str(refused.value)  # no module repr
    assert "`kasoku.compile(pipe)`, not `pipe.unet`" in str(refused.value)
    with pytest.raises(kasoku.KasokuError, match=r"for the folder or hub id .* use "
                                                 r"kasoku.KasokuPipeline.from_pretrained\(PATH\)"):
        kasoku.compile(str(tiny_dir))


def test_the_cli_answers_help_and_argument_errors_without_importing_torch():
    """`kasoku --help`, `--version` and an argument error are answered before torch (3 s to import) is loaded."""
    script = ("import sys\nfrom kasoku.cli import main\n"
              "for argv in (['--help'], ['--version'], ['generate', 'm', 'p', '--steps', '0'], ['tiny', 'x', "
              "'--family', 'sd4'], ['compile', 'm', '--components', 'magic']):\n"
              "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
              "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('torch', 'kasoku')))\n"
              "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
    assert "kasoku 0." in result.stdout  # --version


def test_kasoku_help_answers_in_under_a_second_in_a_new_process():
    """The console script, timed as a user runs it (best of three: a busy CI machine delays single runs)."""
    import shutil
    import time

    script = shutil.which("kasoku", path=str(Path(sys.executable).parent))
    assert script, "the kasoku console script is installed beside this Python"
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
        seconds.append(time.perf_counter() - start)
        assert result.returncode == 0 and "generate" in result.stdout
    assert min(seconds) < 1.0, f"kasoku --help took {min(seconds):.2f} s at best"
