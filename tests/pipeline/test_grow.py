"""Engines that grow with the calls: ordinary diffusers code, with default options, runs unchanged on
`kasoku.compile` and gives diffusers' image, whatever its shape (images, size, T5 tokens); an explicit profile or
`strict_shapes=True` refuses first, naming the Python option."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import kasoku
from kasoku.core.components import ShapeOutOfProfile
from kasoku.core.parity import psnr
from kasoku.families import FAMILIES
from kasoku.model.pipeline_model import Model
from kasoku.pipeline.kasoku_pipeline import EnginesGrow, IgnoredArgument, InvalidInput
from kasoku.tools.tiny import tiny_pipeline
from tests.conftest import tiny_profile

pytestmark = pytest.mark.integration  # builds engines

MIN_PSNR = 40.0
SLOW = pytest.mark.slow(reason="a tiny transformer family exported twice (its default profile, then grown): minutes "
                               "on two cores; SD 1.x runs in make test")


def diffusers_code(family: str, native: int) -> list[dict]:
    """The calls of ordinary diffusers code: 1, 2 and 3 prompts, two images per prompt, a quarter and 3x the native
    size (outside the default profile of half to double), T5 tokens other than the default."""
    # T5 tokens early: the calls after it, without `max_sequence_length`, mean diffusers' default again
    tokens = [dict(prompt="a cat", max_sequence_length=48)] if family in ("sd3", "flux") else []
    calls = [dict(prompt="a cat"), *tokens, dict(prompt=["a cat", "a dog"]),
             dict(prompt=["a cat", "a dog", "a bird"], num_images_per_prompt=2),
             dict(prompt="a cat", height=native // 4, width=native // 4)]
    if native <= 64:  # 3x the tiny Flux's 1024 would be 36,864 tokens of attention per image: the tiny U-Nets' only
        calls.append(dict(prompt="a cat", height=3 * native, width=3 * native))
    return calls


def run(pipe, seed=0, **call):
    return pipe(generator=torch.Generator().manual_seed(seed), num_inference_steps=2, output_type="np", **call).images


def growths(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, EnginesGrow)]


@pytest.mark.parametrize("family", ["sd1", pytest.param("sdxl", marks=SLOW), pytest.param("sd3", marks=SLOW),
                                    pytest.param("flux", marks=SLOW)])
def test_ordinary_diffusers_code_runs_unchanged_with_default_options(family, tiny_pipe, tiny_cache, tmp_path):
    pipe = tiny_pipe if family == "sd1" else tiny_pipeline(family=family)
    pipe.set_progress_bar_config(disable=True)
    native = Model.of(pipe).native_size
    cache = tiny_cache.root if family == "sd1" else tmp_path  # SD 1.x: the session's engines of the default profile
    fast = kasoku.compile(pipe, cache_dir=cache)
    default = fast.profile
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in diffusers_code(family, native):
            assert psnr(run(pipe, **call), run(fast, **call)) >= MIN_PSNR, call
    grown = growths(caught)
    assert grown and all("outside the engines' profile" in g for g in grown)
    # the whole size range with the first build; T5 tokens there and back are two more, and six images one
    assert len(grown) == (3 if family in ("sd3", "flux") else 1)
    assert fast.profile.max.height == 4 * native and fast.profile.min.batch == 1 and fast.profile != default

    # every later call of those shapes runs on the grown engines: nothing is built again. With T5, an engine set per
    # token count: the first round back to 48 tokens builds the set of the images grown since; then both are cached
    if family in ("sd3", "flux"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for call in diffusers_code(family, native):
                run(fast, **call)
    stages = len(fast.compile_report.stages)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        for call in diffusers_code(family, native):
            run(fast, **call)
    assert not growths(again) or family in ("sd3", "flux")  # from one token count to the other: loaded
    assert all(s.status == "reused" for s in fast.compile_report.stages[stages:])

    # img2img with the size arguments of a shared argument dict: ignored as diffusers ignores them
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (native, native, 3), dtype=np.uint8))
    img2img = FAMILIES[Model.of(pipe).family.name].task_pipeline(pipe, "img2img")
    shared = dict(prompt="a cat", height=native, width=native, image=image, strength=0.7)
    takes_size = "height" in _parameters(img2img)  # SD3's and Flux's image-to-image resize to it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(fast, **shared)
    ignored = [str(w.message) for w in caught if issubclass(w.category, IgnoredArgument)]
    assert not ignored if takes_size else any(m.startswith("`height` is ignored in img2img") for m in ignored)
    theirs = shared if takes_size else {k: v for k, v in shared.items() if k not in ("height", "width")}
    assert psnr(run(img2img, **theirs), ours) >= MIN_PSNR


def _parameters(pipe) -> set[str]:
    import inspect

    return set(inspect.signature(type(pipe).__call__).parameters)


@pytest.fixture(scope="module")
def promised(tiny_pipe, tiny_cache, tiny_compiled):
    """The tiny engines (from the session cache) compiled with an explicit profile, and with `strict_shapes=True`."""
    return {"profile": kasoku.compile(tiny_pipe, "onnxruntime", profile=tiny_profile(tiny_pipe),
                                      cache_dir=tiny_cache.root),
            "strict_shapes": kasoku.compile(tiny_pipe, "onnxruntime", strict_shapes=True, cache_dir=tiny_cache.root)}


@pytest.mark.parametrize("how", ["profile", "strict_shapes"])
@pytest.mark.parametrize("call, outside, ranges", [
    (dict(prompt=["a cat", "a dog", "a bird"], num_images_per_prompt=2), "batch=6", r"batch=\(1, 1, 6\)"),
    (dict(prompt="a cat", height=16, width=16), "height=16", r"height=\(16, 64, 128\)"),
    (dict(prompt="a cat", height=192, width=192), "height=192", r"height=\(32, 64, 192\)"),
])
def test_an_explicit_profile_or_strict_shapes_refuses_first_naming_the_option(promised, how, call, outside, ranges):
    fast = promised[how]
    fast.times.reset()
    with pytest.raises(ShapeOutOfProfile, match=rf"{outside} is outside the compiled profile.*kasoku\.compile\(pipe, "
                                                rf"profile=ShapeProfile\.from_ranges\(.*{ranges}.*\)`, or leave out "
                                                r"`profile=` and `strict_shapes=True`"):
        fast(num_inference_steps=2, **call)
    assert not fast.times.calls and fast.profile == tiny_profile(fast.model.pipe)


def test_sizes_off_the_models_step_are_refused_with_the_step_the_help_states(promised, capsys):
    from kasoku.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "16 for the tiny SD" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(InvalidInput, match=r"`height` and `width` must be multiples of 16 for this model's engines"):
        promised["profile"]("a cat", height=72, width=64, num_inference_steps=2)
