"""Step caching's parts that need no engine: the schedules, which layers a branch runs, the full and
shallow torch graphs against diffusers' own U-Net, the dynamic axes export gets, and the batch fields.
(The engines, the pipeline and the CLI on them: tests/pipeline/test_deepcache.py.)"""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from kasoku.architectures.deepcache import Branch, UNetLayers, branch_count
from kasoku.batch import InvalidJobs, Job, plan_batches, read_jobs
from kasoku.core.components import ImageShape
from kasoku.core.options import CompileOptions, InvalidOptions
from kasoku.core.step_cache import (
    DEFAULT_BRANCH,
    FEATURE,
    FULL,
    SHALLOW,
    InvalidStepCache,
    StepCacheRun,
    full_steps,
)
from kasoku.families import FAMILIES
from kasoku.model.pipeline_model import component_specs

# ---- schedules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 2, 4, 7, 8, 20, 21, 50])
@pytest.mark.parametrize("interval", [1, 2, 3, 5])
def test_both_schedules_run_the_first_step_and_as_many_full_steps(length, interval):
    uniform, nonuniform = full_steps(length, interval, "uniform"), full_steps(length, interval, "nonuniform")
    assert uniform == tuple(range(0, length, interval))
    assert len(nonuniform) == len(uniform) == math.ceil(length / interval)
    assert nonuniform[0] == 0 and list(nonuniform) == sorted(set(nonuniform)) and nonuniform[-1] < length


def test_nonuniform_full_steps_are_densest_around_the_centre():
    """The paper's i_k = l_k^p + c, l_k evenly spaced: the gaps grow with the distance from c = 0.3 T."""
    steps = full_steps(50, 5, "nonuniform")
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    around = [g for a, g in zip(steps, gaps) if abs(a - 15) <= 5]
    far = gaps[-2:]
    assert max(around) < min(far), steps
    assert full_steps(50, 5, "uniform") != steps


def test_a_run_follows_its_schedule_from_the_loop_length():
    run = StepCacheRun(3, "nonuniform", loop_length=lambda: 20)
    taken = []
    for _ in range(20):
        taken.append(run.next_is_full())
        run.feature = torch.zeros(1)  # what the full step would keep
    assert [i for i, full in enumerate(taken) if full] == list(full_steps(20, 3, "nonuniform"))


def test_bad_intervals_and_schedules_are_refused():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidStepCache, match="`cache_interval` must be a positive int"):
            full_steps(10, bad)
    with pytest.raises(InvalidStepCache, match="must be one of uniform, nonuniform but is 'linear'"):
        full_steps(10, 2, "linear")


# ---- branches and graphs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def family_pipes():
    """The tiny pipelines of every U-Net family (4-channel), and SDXL's 9-channel inpainting one."""
    cases = [(name, False) for name, family in FAMILIES.items() if family.denoiser == "unet"] + [("sdxl", True)]
    return {(name, inpainting): FAMILIES[name].tiny_pipeline(inpainting=inpainting) for name, inpainting in cases}


def _unet_inputs(pipe, batch=2, height=8, width=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    config = pipe.unet.config
    inputs = [torch.randn(batch, config.in_channels, height, width, generator=generator),
              torch.full((batch,), 500.0),
              torch.randn(batch, pipe.tokenizer.model_max_length, config.cross_attention_dim, generator=generator)]
    added = None
    if config.addition_embed_type == "text_time":
        added = {"text_embeds": torch.randn(batch, pipe.text_encoder_2.config.projection_dim, generator=generator),
                 "time_ids": torch.rand(batch, 6, generator=generator) * 1000}
    return inputs, added


@torch.no_grad()
def test_full_graph_is_diffusers_unet_exactly_and_shallow_reproduces_it_from_its_feature(family_pipes):
    """Every family, 4 and 9 channels (every branch of SD 1.x's, the outermost, a middle and the innermost of
    the others'): the layer-by-layer U-Net gives diffusers' own output bit for bit, its feature has the shape
    the branch's geometry says (from the config alone), and the shallow graph on that feature (the same step)
    gives the same output."""
    for (name, inpainting), pipe in family_pipes.items():
        unet = pipe.unet.eval()
        (sample, timestep, ehs), added = _unet_inputs(pipe)
        expected = unet(sample, timestep, ehs, added_cond_kwargs=added, return_dict=False)[0]
        count = branch_count(unet.config)
        for index in range(count) if name == "sd1" else sorted({0, count // 2, count - 1}):
            branch = Branch.of(unet.config, index)
            layers = UNetLayers(unet, branch)
            out, feature = layers.full(sample, timestep, ehs, added)
            where = f"{name} inpainting={inpainting} branch {index}"
            assert torch.equal(out, expected), where
            assert tuple(feature.shape) == (2, branch.channels, 8 >> branch.level, 16 >> branch.level), where
            assert torch.equal(layers.shallow(sample, timestep, ehs, added, feature), out), where


def test_branch_geometry_of_the_full_size_sd15_unet():
    """SD 1.5's twelve skip branches on the meta device (shapes only): the outermost is conv_in's 320 channels
    at the latent's size, the innermost the last down block's 1280 at 1/8 of it."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(
            layers_per_block=2, block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3).eval()
        sample, timestep, ehs = torch.randn(2, 4, 64, 64), torch.ones(2), torch.randn(2, 77, 768)
        assert branch_count(unet.config) == 12
        for index in range(12):
            branch = Branch.of(unet.config, index)
            _, feature = UNetLayers(unet, branch).full(sample, timestep, ehs)
            assert tuple(feature.shape) == (2, branch.channels, 64 >> branch.level, 64 >> branch.level)
    assert (Branch.of(unet.config, 0).channels, Branch.of(unet.config, 0).level) == (320, 0)
    assert (Branch.of(unet.config, 11).channels, Branch.of(unet.config, 11).level) == (1280, 3)


def test_a_branch_outside_the_unet_is_refused(tiny_pipe):
    with pytest.raises(InvalidStepCache, match=r"`cache_branch` must be a skip branch of this U-Net, 0\.\.3"):
        component_specs(tiny_pipe, names=[SHALLOW], cache_branch=4)
    with pytest.raises(InvalidOptions, match="`cache_branch` must be a skip branch of the U-Net, an int >= 0"):
        CompileOptions(cache_branch=-1)


def test_step_cache_specs_come_from_the_unet_spec(tiny_pipe):
    """Same inputs and weights as the plain U-Net; the feature follows the latent at the branch's depth; the
    branch is part of the architecture (a different branch is a different export)."""
    specs = component_specs(tiny_pipe, names=["unet", FULL, SHALLOW])
    plain, full, shallow = specs["unet"], specs[FULL], specs[SHALLOW]
    assert full.inputs == plain.inputs and full.output_names == ("out_sample", FEATURE)
    assert shallow.input_names == (*plain.input_names, FEATURE) and shallow.output_names == ("out_sample",)
    assert shallow.modules == full.modules == ("unet",) and full.weights() == plain.weights()
    feature = shallow.input_shapes(ImageShape(3, 64, 96))[FEATURE]
    assert feature == (6, Branch.of(tiny_pipe.unet.config, DEFAULT_BRANCH).channels, 8, 12)
    assert full.output_shapes(full.input_shapes(ImageShape(1, 32, 48)))[FEATURE] == (2, feature[1], 4, 6)
    deeper = component_specs(tiny_pipe, names=[SHALLOW], cache_branch=2)[SHALLOW]
    assert deeper.input_shapes(ImageShape(1, 64, 64))[FEATURE][2:] == (4, 4)
    assert len({plain.architecture, full.architecture, shallow.architecture, deeper.architecture}) == 4


def test_export_relates_the_feature_axes_to_the_latent_axes(tiny_pipe):
    """torch.export sees the feature's height as a multiple of the same Dim as the latent's, so it can prove the
    shapes the shallow graph concatenates agree; a spec with one axis per image dimension keeps its Dims."""
    from kasoku.core.components import torch_dynamic_shapes

    def root(dim):
        return getattr(dim, "root", dim)  # a derived Dim (k * base) names its base

    specs = component_specs(tiny_pipe, names=["unet", SHALLOW], cache_branch=2)  # the feature at 1/2 the latent
    shallow = torch_dynamic_shapes(specs[SHALLOW])
    latent, feature = shallow["sample"][2], shallow["rest"][-1][2]  # the deep feature: the last of *rest
    assert root(latent) is root(feature) and latent is not feature
    assert root(latent).__name__.startswith("height_div")  # one Dim of the image height for both axes
    plain = torch_dynamic_shapes(specs["unet"])
    assert root(plain["sample"][2]).__name__ == "latent_height_div2" and plain["timestep"][0].__name__ == "batch"


# ---- batch jobs ----------------------------------------------------------------------------------


def test_jobs_take_step_caching_fields_checked_like_every_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([
        '{"prompt": "a", "cache_interval": 3, "cache_schedule": "nonuniform"}',
        '{"prompt": "b", "cache_interval": 0}',
        '{"prompt": "c", "cache_interval": "2"}',
        '{"prompt": "d", "cache_schedule": "linear"}',
    ]) + "\n")
    with pytest.raises(InvalidJobs) as error:
        read_jobs(path)
    message = str(error.value)
    assert message.startswith(f"3 lines of {path} cannot be run")
    assert f"{path}:2: `cache_interval` must be an integer >= 1 (1: no step caching) but is 0." in message
    assert f'{path}:3: `cache_interval` must be an integer >= 1 (1: no step caching) but is "2".' in message
    assert f'{path}:4: `cache_schedule` must be one of uniform, nonuniform but is "linear".' in message
    path.write_text('{"prompt": "a", "cache_interval": 3, "cache_schedule": "nonuniform"}\n')
    job, = read_jobs(path)
    assert (job.cache_interval, job.cache_schedule) == (3, "nonuniform")


def test_step_caching_is_in_the_job_key_and_the_call_key_and_old_keys_stay():
    plain = Job("a", "p", 1, height=64, width=64, steps=30, guidance=7.5)  # as `prepare` fills in SD's defaults
    # the key of a job without step caching is what it was before the fields existed (a re-run skips it)
    before = {"id": "a", "prompt": "p", "negative_prompt": None, "seed": 1, "steps": 30, "guidance": 7.5,
              "height": 64, "width": 64}
    assert plain.key == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    cached = Job("a", "p", 1, height=64, width=64, steps=30, guidance=7.5, cache_interval=3)
    nonuniform = Job("a", "p", 1, height=64, width=64, steps=30, guidance=7.5, cache_interval=3,
                     cache_schedule="nonuniform")
    assert len({plain.key, cached.key, nonuniform.key}) == 3
    jobs = [Job(str(i), "p", i, height=64, width=64, cache_interval=1 + i % 2) for i in range(4)]
    assert [[j.id for j in b] for b in plan_batches(jobs, 4)] == [["0", "2"], ["1", "3"]]
