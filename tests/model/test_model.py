"""The Model object (a pipeline, its family, lazy loading, weight digests) and what is refused before any weight
is read: a build that would not fit in memory, a folder missing a component."""

from __future__ import annotations

import shutil

import pytest

from kasoku.core.components import ShapeProfile
from kasoku.families import FAMILIES
from kasoku.model.loading import ModelNotFound
from kasoku.model.pipeline_model import Model


def test_a_model_answers_through_its_family(tiny_pipe):
    model = Model.of(tiny_pipe)
    assert Model.of(model) is model and model.family is FAMILIES["sd1"]
    assert model.components == ("text_encoder", "unet", "vae_decoder", "vae_encoder")
    assert model.tasks == ("txt2img", "img2img", "inpaint") and model.task == "txt2img"
    assert model.task_components("txt2img") == ("text_encoder", "unet", "vae_decoder")
    assert (model.native_size, model.pixel_multiple, model.controlnets) == (64, 16, 0)
    assert model.default_profile() == ShapeProfile.from_ranges((1, 1, 4), (32, 64, 128), (32, 64, 128), 16)
    ref = model.ref("unet")
    assert ref.path == "unet" and ref.config is tiny_pipe.unet.config and ref.load() is tiny_pipe.unet


def test_a_lazily_loaded_model_reads_no_weights_until_asked(tiny_dir, tmp_path):
    model = Model.load(tiny_dir, lazy=True).remember_digests_under(tmp_path)
    assert not model.is_loaded("unet") and not model.digest_known("unet")
    assert model.weight_bytes("unet") == 4 * sum(p.numel() for p in model.pipe.unet.parameters())
    digest = model.ref("unet").digest()  # loads the weights once, and remembers the digest under the cache
    again = Model.load(tiny_dir, lazy=True).remember_digests_under(tmp_path)
    assert again.digest_known("unet") and again.ref("unet").digest() == digest and not again.is_loaded("unet")


def test_a_build_that_would_not_fit_is_refused_before_a_weight_is_read(tiny_dir, tmp_path, monkeypatch):
    import kasoku
    from kasoku.pipeline import compiling

    unet_bytes = Model.load(tiny_dir, lazy=True).weight_bytes("unet")
    monkeypatch.setattr(compiling, "available_memory", lambda: int(1.5 * unet_bytes))  # less than 2x the U-Net
    with pytest.raises(compiling.NotEnoughMemory, match=r"unet has .* GiB of fp32 weights; building its engine "
                                                         r"needs about .* Leave it out .*KASOKU_MEMORY_CHECK=0"):
        kasoku.KasokuPipeline.from_pretrained(str(tiny_dir), "onnxruntime", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "entries").exists() or not any((tmp_path / "cache" / "entries").iterdir())
    monkeypatch.setenv(compiling.MEMORY_CHECK_ENV, "0")
    compiling.check_memory(Model.load(tiny_dir, lazy=True),
                           Model.load(tiny_dir, lazy=True).specs(names=["unet"]))  # the check is off: no error


def test_a_folder_missing_a_component_says_so_and_not_that_the_network_failed(tiny_dir, tmp_path):
    folder = tmp_path / "partial"
    shutil.copytree(tiny_dir, folder)
    shutil.rmtree(folder / "vae")
    with pytest.raises(ModelNotFound, match=r"incomplete: model_index.json lists vae \(AutoencoderKL\).*not a "
                                            r"network problem"):
        Model.load(folder, lazy=True)


def test_a_live_pipeline_is_named_in_the_cache_by_its_weights(tiny_pipe, tiny_specs):
    """`kasoku.compile(pipe)` labels its entries `Class@digest`: two live pipelines of one class are two models."""
    from kasoku.pipeline.compiling import live_label
    from kasoku.tools.tiny import tiny_pipeline

    label = live_label(Model.of(tiny_pipe), tiny_specs)
    assert label.startswith("StableDiffusionPipeline@") and len(label.split("@")[1]) == 12
    assert live_label(Model.of(tiny_pipe), tiny_specs) == label  # the same weights, the same name
    other = tiny_pipeline(seed=1)
    assert live_label(Model.of(other), tiny_specs) != label


def test_a_pipeline_read_in_bf16_keeps_its_dtypes_where_a_family_compiles_them(tiny_pipe, tiny_dir):
    """diffusers' from_pipe casts every module to fp32 in place; kasoku's task pipelines keep the user's dtypes. A
    hand-written family compiles from fp32 copies (its graphs are written in fp32), leaving the user's modules as they
    are; a folder read in bf16 reads bf16 weights (counted at 2 bytes each by the memory guard)."""
    import copy

    import torch

    from kasoku.families.base import from_pipe

    pipe = copy.deepcopy(tiny_pipe).to(torch.bfloat16)
    img2img = Model.of(pipe).family.task_pipeline(pipe, "img2img")
    assert img2img.unet is pipe.unet and pipe.unet.dtype == torch.bfloat16
    assert from_pipe(type(pipe), pipe).vae.dtype == torch.bfloat16

    model = Model.of(pipe)
    assert model.pipe.unet.dtype == torch.float32 and model.pipe.unet is not pipe.unet
    assert pipe.unet.dtype == torch.bfloat16 and not model.in_bf16("unet")
    assert torch.equal(model.pipe.unet.conv_in.weight, pipe.unet.conv_in.weight.float())

    lazy = Model.load(tiny_dir, lazy=True, torch_dtype=torch.bfloat16)
    assert lazy.pipe.unet.dtype == torch.float32  # relabelled on the meta device: SD reads fp32
    assert lazy.weight_bytes("unet") == 4 * sum(p.numel() for p in lazy.pipe.unet.parameters())


def test_from_pretrained_takes_diffusers_dtype_names_and_refuses_what_it_cannot_read(tiny_dir):
    import torch

    from kasoku import KasokuPipeline
    from kasoku.core.options import InvalidOptions
    from kasoku.pipeline.kasoku_pipeline import loading_dtype

    assert loading_dtype(torch.bfloat16) is torch.bfloat16 and loading_dtype(dtype="bfloat16") is torch.bfloat16
    assert loading_dtype() is None
    with pytest.raises(InvalidOptions, match="float32 or torch.bfloat16"):
        KasokuPipeline.from_pretrained(tiny_dir, torch_dtype=torch.float16)
    with pytest.raises(InvalidOptions, match="disagree"):
        KasokuPipeline.from_pretrained(tiny_dir, torch_dtype=torch.float32, dtype=torch.bfloat16)


def test_a_weights_digest_is_kept_only_while_its_module_lives():
    # a digest kept under a dead module's id would be served to the next module created at its address
    import gc
    import weakref
    from types import SimpleNamespace

    import torch

    from kasoku.model.fingerprint import WeightsFingerprints

    pipe, weights = SimpleNamespace(transformer=torch.nn.Linear(4, 4)), WeightsFingerprints()
    first = weights.of(pipe, "transformer")
    gone = weakref.ref(pipe.transformer)
    pipe.transformer = torch.nn.Linear(4, 4)
    gc.collect()
    assert gone() is None and len(weights._computed) == 0
    assert weights.of(pipe, "transformer") != first and len(weights._computed) == 1
