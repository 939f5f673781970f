"""Step caching (DeepCache) on the tiny families: the full and shallow U-Net engines, the schedule the
pipeline runs them on, its fidelity report, and the CLI and batch surfaces.

The SD 1.x engines are built once (ONNX Runtime, through export, the cache and the parity checks like
every component); the other families run on the torch reference backend (the same graphs, no export),
so the file stays within a few minutes on two cores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import kasoku
from kasoku.batch import prepare, read_jobs, run_local
from kasoku.cli import main
from kasoku.core.parity import STEP_CACHE, TOLERANCES, compare_output, psnr
from kasoku.core.step_cache import FEATURE, FULL, SHALLOW, full_steps
from kasoku.families import FAMILIES

pytestmark = pytest.mark.integration  # exports or builds engines

PROMPT = "a photo of an astronaut riding a horse"
STEPS = 7  # the tiny SD 1.x scheduler (PNDM) makes 8 U-Net calls of it


@pytest.fixture(scope="module")
def cached_pipe(tiny_pipe, tiny_cache):
    """The tiny SD 1.x pipeline on ONNX Runtime with its step-cache engines (plain engines shared with the
    session's other ONNX Runtime tests through the cache)."""
    return kasoku.compile(tiny_pipe, "onnxruntime", cache_dir=tiny_cache.root, step_cache=True)


def generate(pipe, steps=STEPS, seed=0, **kwargs):
    """(images, engine calls) of one call."""
    pipe.times.reset()
    images = pipe(PROMPT, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                  output_type="np", **kwargs).images
    return images, dict(pipe.times.calls)


def engine_per_step(pipe, **kwargs) -> list[str]:
    """Which U-Net engine ran at each step of one call (read from the call counts after every step)."""
    seen, counts = [], {}

    def on_step(_pipe, _step, _timestep, callback_kwargs):
        now = {n: pipe.times.calls.get(n, 0) for n in ("unet", FULL, SHALLOW)}
        seen.append(next(n for n in now if now[n] != counts.get(n, 0)))
        counts.update(now)
        return callback_kwargs

    generate(pipe, callback_on_step_end=on_step, **kwargs)
    return seen


# ---- the engines ---------------------------------------------------------------------------------


def test_step_cache_engines_are_cache_entries_proven_against_torch(cached_pipe):
    """Each graph's engine entry records the parity check its build ran against the graph's own torch module:
    every output (the full graph's deep feature too) at two shapes of the profile, at the fp32 bound."""
    report = cached_pipe.compile_report
    assert report.backends[FULL] == report.backends[SHALLOW] == "onnxruntime"
    for name, outputs in ((FULL, {"out_sample", FEATURE}), (SHALLOW, {"out_sample"})):
        engine, = (s for s in report.stages if s.component == name and s.stage == "engine")
        parity = engine.detail["parity"]
        assert {p["output"] for p in parity} == outputs and len({p["shape"] for p in parity}) == 2
        assert all(p["passed"] and p["max_abs"] <= p["limit"] for p in parity)


def test_full_graph_noise_prediction_is_the_plain_unets(cached_pipe, tiny_specs):
    """At the fp32 engine bound against the plain U-Net's torch module, and against the plain U-Net engine."""
    spec = tiny_specs["unet"]
    for shape in (spec.profile.opt, kasoku.ImageShape(2, 32, 48)):
        inputs = spec.sample_inputs(shape, seed=5)
        full = cached_pipe.engines[FULL].run(inputs)
        plain = cached_pipe.engines["unet"].run(inputs)["out_sample"]
        torch_plain = spec.run_torch({k: v.numpy() for k, v in inputs.items()})["out_sample"]
        for reference, label in ((torch_plain, "torch unet"), (plain, "unet engine")):
            result = compare_output(FULL, "out_sample", f"{shape} vs {label}", reference, full["out_sample"])
            assert result.passed, result.line()


def test_shallow_graph_on_the_full_graphs_feature_matches_the_full_graph(cached_pipe, tiny_specs):
    """The same step: the shallow engine, given the full engine's deep feature, predicts what the full engine
    did (max|Δ| at the fp32 bound), at two shapes (the feature's size follows the latent's)."""
    spec = tiny_specs["unet"]
    for shape in (spec.profile.opt, kasoku.ImageShape(2, 32, 48)):
        inputs = spec.sample_inputs(shape, seed=6)
        full = cached_pipe.engines[FULL].run(inputs)
        shallow = cached_pipe.engines[SHALLOW].run({**inputs, FEATURE: full[FEATURE]})
        result = compare_output(SHALLOW, "out_sample", str(shape), full["out_sample"], shallow["out_sample"])
        assert result.passed, result.line()


# ---- the pipeline ----------------------------------------------------------------------------------


def test_interval_1_gives_exactly_the_uncached_images(cached_pipe):
    plain, plain_calls = generate(cached_pipe)
    for schedule in ("uniform", "nonuniform"):
        same, calls = generate(cached_pipe, cache_interval=1, cache_schedule=schedule)
        assert same.tobytes() == plain.tobytes()
        assert calls == plain_calls and calls["unet"] == STEPS + 1 and FULL not in calls and SHALLOW not in calls


@pytest.mark.parametrize("interval, schedule", [(2, "uniform"), (3, "uniform"), (3, "nonuniform"), (5, "uniform")])
def test_shallow_engine_runs_on_exactly_the_steps_the_schedule_says(cached_pipe, interval, schedule):
    loop = STEPS + 1
    full = set(full_steps(loop, interval, schedule))
    assert engine_per_step(cached_pipe, cache_interval=interval, cache_schedule=schedule) == \
        [FULL if step in full else SHALLOW for step in range(loop)]
    _, calls = generate(cached_pipe, cache_interval=interval, cache_schedule=schedule)
    assert (calls[FULL], calls[SHALLOW], calls.get("unet", 0)) == (len(full), loop - len(full), 0)


def test_the_step_state_belongs_to_one_call(cached_pipe):
    """Calls with caching repeat themselves exactly, whatever ran before (the counter and the feature reset)."""
    first, _ = generate(cached_pipe, cache_interval=3)
    generate(cached_pipe, steps=4, cache_interval=2, guidance_scale=1.0)  # another batch size and rhythm between
    again, _ = generate(cached_pipe, cache_interval=3)
    assert again.tobytes() == first.tobytes()
    uncached, _ = generate(cached_pipe)
    assert uncached.tobytes() != first.tobytes() and psnr(uncached, first) > 20


def test_guidance_img2img_and_4_channel_inpainting_run_cached(cached_pipe):
    init = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    cases = {"no guidance": dict(guidance_scale=1.0), "guidance": dict(guidance_scale=7.5),
             "img2img": dict(image=init, strength=0.6), "inpaint": dict(image=init, mask_image=Image.fromarray(mask))}
    for name, kwargs in cases.items():
        cached, calls = generate(cached_pipe, cache_interval=2, **kwargs)
        uncached, _ = generate(cached_pipe, **kwargs)
        assert calls[SHALLOW] >= 1 and calls[FULL] >= 1 and "unet" not in calls, name
        assert cached.shape == uncached.shape and np.isfinite(cached).all(), name


def test_a_pipeline_compiled_without_step_caching_builds_its_engines_on_the_first_call(tiny_pipe, tiny_cache,
                                                                                        cached_pipe):
    pipe = kasoku.compile(tiny_pipe, "onnxruntime", cache_dir=tiny_cache.root)
    assert FULL not in pipe.engines
    plain, _ = generate(pipe, cache_interval=1)
    assert FULL not in pipe.engines  # interval 1 never needs them
    cached, calls = generate(pipe, cache_interval=3)
    assert {FULL, SHALLOW} <= set(pipe.engines) and calls[SHALLOW] == 5
    assert {s.status for s in pipe.compile_report.stages if s.component in (FULL, SHALLOW)} == {"reused"}
    assert cached.tobytes() == generate(cached_pipe, cache_interval=3)[0].tobytes()


@pytest.mark.parametrize("family, inpainting", [("sd2", False), ("sdxl", True)])
def test_every_family_and_the_9_channel_unet_run_cached(family, inpainting, tmp_path):
    """SD 2.x, and SDXL (its added conditioning in both graphs) with a 9-channel inpainting U-Net, on the torch
    reference backend: the schedule's engines run and caching moves the image only a little (SD 1.x and 4
    channels: the tests above; every family's graphs against diffusers: tests/core/test_step_cache.py)."""
    reference = FAMILIES[family].tiny_pipeline(inpainting=inpainting)
    pipe = kasoku.compile(reference, "torch", cache_dir=tmp_path, step_cache=True)
    kwargs = {}
    if inpainting:
        init = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8))
        mask = np.zeros((64, 64), np.uint8)
        mask[8:40, 8:40] = 255
        kwargs = dict(image=init, mask_image=Image.fromarray(mask))
    uncached, plain_calls = generate(pipe, steps=6, **kwargs)
    cached, calls = generate(pipe, steps=6, cache_interval=3, **kwargs)
    loop = plain_calls["unet"]
    assert (calls[FULL], calls[SHALLOW]) == (len(full_steps(loop, 3)), loop - len(full_steps(loop, 3)))
    assert np.isfinite(cached).all() and psnr(uncached, cached) > 20


# ---- fidelity, CLI and batch ---------------------------------------------------------------------------


def test_verify_reports_the_cached_images_against_the_uncached(tiny_dir, tiny_cache, cached_pipe, tmp_path, capsys):
    out = tmp_path / "verify.json"
    code = main(["verify", str(tiny_dir), "--backend", "onnxruntime", "--cache-dir", str(tiny_cache.root),
                 "--cache-interval", "3", "--json", str(out)])
    report = json.loads(out.read_text())
    assert {c["component"] for c in report["components"]} >= {FULL, SHALLOW}
    assert all(c["passed"] for c in report["components"])
    step_cache = report["step_cache"]
    tolerance = TOLERANCES[STEP_CACHE]
    assert len(step_cache["per_prompt"]) == 3 and "deepcache interval 3 (uniform)" in step_cache["reference"]
    assert step_cache["bound_db"] == tolerance.image_psnr_db and step_cache["bound_ssim"] == tolerance.image_ssim
    assert step_cache["passed"] == (step_cache["psnr_db"] >= tolerance.image_psnr_db
                                    and step_cache["ssim"] >= tolerance.image_ssim)
    assert code == (0 if report["passed"] else 1) and step_cache["passed"]
    assert "Step caching: image vs the same engines without step caching" in capsys.readouterr().out


def test_generate_with_a_cache_interval_shows_the_engines_calls(tiny_dir, tiny_cache, cached_pipe, tmp_path,
                                                                capsys):
    out = tmp_path / "cat.png"
    assert main(["generate", str(tiny_dir), PROMPT, "-o", str(out), "--steps", "5", "--backend", "onnxruntime",
                 "--cache-dir", str(tiny_cache.root), "--cache-interval", "2"]) == 0
    text = capsys.readouterr().out
    assert Image.open(out).size == (64, 64)
    assert "unet_full" in text and "3 calls" in text and "unet_shallow" in text  # PNDM: 6 calls, full at 0, 2, 4


def test_batch_jobs_with_and_without_caching_never_share_a_call(tiny_dir, tiny_cache, cached_pipe, tmp_path):
    jobs_file = tmp_path / "jobs.jsonl"
    jobs_file.write_text("\n".join(json.dumps(job) for job in [
        {"prompt": PROMPT, "seed": 1, "steps": 5, "id": "plain"},
        {"prompt": PROMPT, "seed": 1, "steps": 5, "id": "cached", "cache_interval": 2},
        {"prompt": PROMPT, "seed": 1, "steps": 5, "id": "nonuniform", "cache_interval": 2,
         "cache_schedule": "nonuniform", "guidance": 1.0},  # mixed guidance: the engines serve both (default profile)
    ]) + "\n")
    # the model's default range (not exact-shape engines for the jobs' one size): the engines built above
    plan = prepare(tiny_dir, read_jobs(jobs_file), tmp_path / "out", batch_size=4, backend="onnxruntime",
                   cache_dir=tiny_cache.root, height=(32, 64, 128), width=(32, 64, 128))
    assert plan.recipe.options.profile == cached_pipe.profile
    assert plan.recipe.options.step_cache
    result = run_local(plan)
    assert result.generated == 3
    results = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["images_in_call"] for line in results) == [1, 1, 1]  # three call keys
    plain, cached = (np.asarray(Image.open(tmp_path / "out" / f"{i}.png")) for i in ("plain", "cached"))
    assert plain.tobytes() != cached.tobytes()
