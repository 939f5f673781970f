"""LoRA adapters and fine-tuned checkpoints without re-export: graphs keyed by architecture, weights bound.

Adapters are built with PEFT on the tiny pipeline (random A and B at a visible scale) and saved with
diffusers' own `save_lora_weights`; kasoku's images are compared with diffusers' with the same adapters
(U-Net LoRA: diffusers loads it; text-encoder LoRA: transformers 5 needs PEFT >= 0.22 to load it, so the
reference is a text encoder merged by hand). Each backend runs both ways of binding: LoRA targets as
run-time weights, and engines rebuilt in memory with merged constants."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import kasoku
from kasoku.core.components import Precision
from kasoku.core.parity import TOLERANCES, psnr
from kasoku.tools.tiny import tiny_pipeline

pytestmark = pytest.mark.integration  # builds engines

MIN_PSNR = TOLERANCES[Precision.FP32].image_psnr_db
TXT2IMG = ("text_encoder", "unet", "vae_decoder")
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
# (backend, lora targets). Both ways of binding run in each: the attention projections (U-Net and text encoder)
# are run-time weights, rebound; adapter b's proj_in and ff.net.2 are constants, so the U-Net engine is rebuilt
# in memory with them merged.
WAYS = [("onnxruntime", "attention"), ("openvino", "attention")]


def image(pipe, seed=0):
    return pipe("a photo of a cat", num_inference_steps=3, generator=torch.Generator().manual_seed(seed),
                output_type="np").images[0]


def _save_unet_adapter(folder, seed, rank, alpha, targets):
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = tiny_pipeline()
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    pipe.unet.add_adapter(config)
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=get_peft_model_state_dict(pipe.unet),
                                              unet_lora_adapter_metadata=config.to_dict())
    return folder


def _save_text_encoder_adapter(folder, seed):
    """PEFT injected directly (transformers' own integration wants PEFT >= 0.22); the layers it holds."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    encoder = copy.deepcopy(tiny_pipeline().text_encoder)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"],
                        init_lora_weights=False)
    inject_adapter_in_model(config, encoder, adapter_name="default")
    layers = get_peft_model_state_dict(encoder, adapter_name="default")
    StableDiffusionPipeline.save_lora_weights(folder, text_encoder_lora_layers=layers,
                                              text_encoder_lora_adapter_metadata=config.to_dict())
    return folder, layers, config.lora_alpha / config.r


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    # a: the attention projections; b: a higher rank, and modules outside the attention targets too
    a = _save_unet_adapter(root / "a", seed=1, rank=4, alpha=8, targets=ATTENTION)
    b = _save_unet_adapter(root / "b", seed=2, rank=8, alpha=4, targets=[*ATTENTION, "proj_in", "ff.net.2"])
    te, te_layers, te_scale = _save_text_encoder_adapter(root / "te", seed=3)
    return {"a": a, "b": b, "te": te, "te_layers": te_layers, "te_scale": te_scale}


@pytest.fixture(scope="module")
def reference():
    """diffusers' own pipeline (the tiny one's weights), adapters loaded as each test needs."""
    return tiny_pipeline()


@pytest.fixture(scope="module", params=WAYS, ids=[f"{b}-{t or 'constants'}" for b, t in WAYS])
def fast(request, tiny_cache):
    backend, targets = request.param
    return kasoku.compile(tiny_pipeline(), backend, cache_dir=tiny_cache.root, components=TXT2IMG,
                          lora_targets=targets)


@pytest.fixture
def clean(fast, reference):
    """Each test starts from no adapters on either pipeline."""
    yield
    fast.unload_lora_weights()
    fast.unfuse_lora()
    reference.unload_lora_weights()


def unet_outputs(fast):
    spec = fast.engines["unet"].spec
    return fast.engines["unet"].run(spec.sample_inputs(spec.profile.opt, seed=5))["out_sample"].numpy().copy()


def test_one_adapter_matches_diffusers(fast, reference, adapters, clean, tiny_cache):
    base = image(fast)
    entries = {e.key for e in tiny_cache.list()}
    fast.load_lora_weights(str(adapters["a"]), adapter_name="a")
    reference.load_lora_weights(str(adapters["a"]), adapter_name="a")
    adapted = image(fast)
    assert psnr(image(reference), adapted) >= MIN_PSNR
    assert psnr(base, adapted) < MIN_PSNR  # the adapter visibly changes the image
    assert {e.key for e in tiny_cache.list()} == entries  # rebound: nothing exported, nothing cached
    assert fast.get_active_adapters() == ["a"] and fast.get_list_adapters()["unet"] == ["a"]


def test_two_adapters_blended_with_weights(fast, reference, adapters, clean):
    for pipe in (fast, reference):
        pipe.load_lora_weights(str(adapters["a"]), adapter_name="a")
        pipe.load_lora_weights(str(adapters["b"]), adapter_name="b")
        pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 1.5])
    assert psnr(image(reference), image(fast)) >= MIN_PSNR
    fast.set_adapters("b", 0.7)
    reference.set_adapters("b", 0.7)
    assert psnr(image(reference), image(fast)) >= MIN_PSNR


def test_disable_then_unload_restores_the_base_exactly(fast, reference, adapters, clean):
    base_image, base_unet = image(fast), unet_outputs(fast)
    for pipe in (fast, reference):
        pipe.load_lora_weights(str(adapters["a"]), adapter_name="a")
        pipe.load_lora_weights(str(adapters["b"]), adapter_name="b")
        pipe.set_adapters(["a", "b"], adapter_weights=[1.0, 0.8])
        pipe.disable_lora()
    assert psnr(image(reference), image(fast)) >= MIN_PSNR
    np.testing.assert_array_equal(unet_outputs(fast), base_unet)  # disabled: the base weights, bit for bit
    fast.enable_lora()
    assert psnr(base_image, image(fast)) < MIN_PSNR
    fast.unload_lora_weights()
    np.testing.assert_array_equal(unet_outputs(fast), base_unet)  # kept, never subtracted
    np.testing.assert_array_equal(image(fast), base_image)
    assert fast.get_list_adapters() == {"text_encoder": [], "unet": []}


def test_text_encoder_lora_matches_a_reference_merged_by_hand(fast, adapters, clean):
    by_hand = tiny_pipeline()
    layers, scale = adapters["te_layers"], adapters["te_scale"]
    with torch.no_grad():
        for key, down in layers.items():
            if ".lora_A." in key:
                module = key.split(".lora_A.")[0]
                by_hand.text_encoder.get_submodule(module).weight += scale * (layers[f"{module}.lora_B.weight"] @ down)
    base = image(fast)
    fast.load_lora_weights(str(adapters["te"]), adapter_name="te")
    assert psnr(image(by_hand), image(fast)) >= MIN_PSNR
    assert psnr(base, image(fast)) < MIN_PSNR


def test_fuse_stays_after_unload_and_unfuse_restores_the_base(fast, reference, adapters, clean):
    base_unet = unet_outputs(fast)
    for pipe in (fast, reference):
        pipe.load_lora_weights(str(adapters["a"]), adapter_name="a")
        pipe.fuse_lora(lora_scale=0.6)
        pipe.unload_lora_weights()
    assert psnr(image(reference), image(fast)) >= MIN_PSNR  # fused weights stay, as in diffusers
    fast.unfuse_lora()
    np.testing.assert_array_equal(unet_outputs(fast), base_unet)
    reference.unfuse_lora()  # diffusers subtracts (close, not exact); rebuild its reference instead
    reference.unet.load_state_dict(tiny_pipeline().unet.state_dict())


def test_bad_adapter_names_and_weights_are_refused(fast, adapters, clean):
    from kasoku.runtime.lora import LoraError

    fast.load_lora_weights(str(adapters["a"]), adapter_name="a")
    with pytest.raises(LoraError, match="adapter name 'a' is already in use"):
        fast.load_lora_weights(str(adapters["b"]), adapter_name="a")
    with pytest.raises(LoraError, match="no adapter is named 'c'; loaded adapters: a"):
        fast.set_adapters(["a", "c"])
    with pytest.raises(LoraError, match="one weight per adapter: 1 adapter"):
        fast.set_adapters(["a"], [0.5, 0.5])
    with pytest.raises(LoraError, match="a weight is a finite number"):
        fast.set_adapters(["a"], [float("nan")])


# ---- checkpoints of one architecture ---------------------------------------------------------------


def test_a_second_checkpoint_reuses_the_graphs(tiny_cache, tmp_path):
    """Another fine-tune (the tiny pipeline with other weights): no export, only engines, its own images."""
    first = kasoku.compile(tiny_pipeline(), "onnxruntime", cache_dir=tiny_cache.root, components=TXT2IMG)
    graphs = {e.key for e in tiny_cache.list() if e.kind == "graph"}
    other = tiny_pipeline(seed=7)
    fast = kasoku.compile(other, "onnxruntime", cache_dir=tiny_cache.root, components=TXT2IMG)
    statuses = fast.compile_report.statuses()
    assert {statuses[(c, "export")] for c in TXT2IMG} == {"reused"}
    assert {statuses[(c, "engine")] for c in TXT2IMG} == {"built"}
    assert {e.key for e in tiny_cache.list() if e.kind == "graph"} == graphs  # no new export entry
    assert psnr(image(other), image(fast)) >= MIN_PSNR
    assert psnr(image(first), image(fast)) < MIN_PSNR  # other weights, another image
    engine = next(s for s in fast.compile_report.stages if s.component == "unet" and s.stage == "engine")
    assert len({p["shape"] for p in engine.detail["parity"]}) == 1  # the graph was proven; only the weights are new


@pytest.mark.parametrize("fused", [False, True], ids=["peft-layers", "fused"])
def test_compile_gives_the_images_of_a_pipeline_with_diffusers_lora(fused, adapters, tiny_cache):
    from kasoku.model.fingerprint import module_fingerprint

    pipe = tiny_pipeline()
    before = module_fingerprint(pipe.unet)
    pipe.load_lora_weights(str(adapters["a"]), adapter_name="a")
    if fused:
        pipe.fuse_lora(lora_scale=0.7)
    assert module_fingerprint(pipe.unet) != before  # the weights the engine binds changed
    fast = kasoku.compile(pipe, "onnxruntime", cache_dir=tiny_cache.root, components=TXT2IMG)
    assert fast.compile_report.statuses()[("unet", "export")] == "reused"  # the base architecture's graph
    assert psnr(image(pipe), image(fast)) >= MIN_PSNR


# ---- the command line and batch ------------------------------------------------------------------------


def test_generate_with_lora_flags(tiny_dir, tiny_cache, adapters, tmp_path):
    from PIL import Image

    from kasoku.cli import main

    # the components and targets of the `fast` engines: generate finds them in the cache (no exact-shape export)
    common = ["generate", str(tiny_dir), "a photo of a cat", "--steps", "3", "--backend", "onnxruntime",
              "--cache-dir", str(tiny_cache.root), "--lora-targets", "attention", "--components", *TXT2IMG]
    assert main([*common, "-o", str(tmp_path / "base.png")]) == 0
    assert main([*common, "-o", str(tmp_path / "lora.png"), "--lora", f"{adapters['a']}:0.8",
                 "--lora", str(adapters["te"])]) == 0
    reference = tiny_pipeline()
    reference.load_lora_weights(str(adapters["a"]), adapter_name="a")
    reference.set_adapters("a", 0.8)
    encoder = reference.text_encoder
    with torch.no_grad():
        for key, down in adapters["te_layers"].items():
            if ".lora_A." in key:
                module = key.split(".lora_A.")[0]
                encoder.get_submodule(module).weight += adapters["te_scale"] * (
                    adapters["te_layers"][f"{module}.lora_B.weight"] @ down)
    want = reference("a photo of a cat", num_inference_steps=3, generator=torch.Generator().manual_seed(0)).images[0]
    got = np.asarray(Image.open(tmp_path / "lora.png"), np.float32) / 255
    assert psnr(np.asarray(want, np.float32) / 255, got) >= MIN_PSNR
    assert not np.array_equal(np.asarray(Image.open(tmp_path / "base.png")), got)


def test_batch_jobs_with_loras_share_a_pipeline(tiny_dir, tiny_cache, adapters, tmp_path):
    from PIL import Image

    from kasoku.batch import plan_batches, prepare, read_jobs, run_local

    lines = [{"prompt": "a photo of a cat", "id": "base", "steps": 3, "seed": 0},
             {"prompt": "a photo of a cat", "id": "a1", "steps": 3, "seed": 0, "loras": [f"{adapters['a']}:0.8"]},
             {"prompt": "a photo of a dog", "id": "a2", "steps": 3, "seed": 1,
              "loras": [{"path": str(adapters["a"]), "scale": 0.8}]},
             {"prompt": "a photo of a cat", "id": "base2", "steps": 3, "seed": 0}]
    (tmp_path / "jobs.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    jobs = read_jobs(tmp_path / "jobs.jsonl")
    assert [[j.id for j in batch] for batch in plan_batches(jobs, 4)] == [["base", "base2"], ["a1", "a2"]]
    plan = prepare(tiny_dir, jobs, tmp_path / "out", batch_size=4, backend="onnxruntime", cache_dir=tiny_cache.root,
                   lora_targets="attention")
    # the model's default profile: the `fast` engines in the cache (the jobs' own exact shape would export again)
    plan.recipe = replace(plan.recipe, options=plan.recipe.options.replace(profile=None))
    assert run_local(plan).generated == 4
    out = {job: np.asarray(Image.open(tmp_path / "out" / f"{job}.png"), np.float32) / 255
           for job in ("base", "base2", "a1")}
    assert psnr(out["base"], out["base2"]) >= MIN_PSNR  # one call per adapter set
    assert psnr(out["base"], out["a1"]) < MIN_PSNR


def test_serve_requests_name_adapters_and_get_diffusers_images(tiny_dir, tiny_cache, adapters):
    """`kasoku serve --lora a=FILE`: a request with `loras` runs that adapter set; the next one without, the base."""
    pytest.importorskip("fastapi")
    import base64
    import io

    from fastapi.testclient import TestClient
    from PIL import Image

    from kasoku.core.options import CompileOptions, lora_targets
    from kasoku.serve import ImageService, prepare_serving
    from kasoku.serve.app import create_app
    from kasoku.serve.config import Size

    # the default profile with the attention targets: the `fast` fixture's engines where it ran first
    config, model = prepare_serving(str(tiny_dir), CompileOptions(backend="onnxruntime", cache_dir=tiny_cache.root,
                                                                  components=TXT2IMG),
                                    sizes=(Size(64, 64),), max_batch=2, loras=(("a", str(adapters["a"])),))
    assert config.options.lora_targets == lora_targets(("attention",))
    service = ImageService(config)
    service.load(model)

    def ask(client, **fields):
        answer = client.post("/v1/images/generations", json={"prompt": "a photo of a cat", "steps": 3, "seed": 0,
                                                              **fields})
        assert answer.status_code == 200, answer.text
        data = base64.b64decode(answer.json()["data"][0]["b64_json"])
        return np.asarray(Image.open(io.BytesIO(data)), np.float32) / 255

    with TestClient(create_app(service)) as client:
        base, adapted, base_again = ask(client), ask(client, loras=["a:0.8"]), ask(client)
        assert client.get("/readyz").json()["loras"] == ["a"]
    reference = tiny_pipeline()
    reference.load_lora_weights(str(adapters["a"]), adapter_name="a")
    reference.set_adapters("a", 0.8)
    want = image(reference)
    assert psnr(want, adapted) >= MIN_PSNR
    np.testing.assert_array_equal(base, base_again)  # switched back to the base weights exactly
    assert psnr(base, adapted) < MIN_PSNR


def _tensorrt_reason() -> str:
    from kasoku.backends.tensorrt import TensorRTBackend

    availability = TensorRTBackend.availability()
    return "" if availability.available else f"TensorRT unavailable: {availability.reason}"


@pytest.mark.gpu
@pytest.mark.skipif(bool(_tensorrt_reason()), reason=_tensorrt_reason() or "TensorRT available")
def test_tensorrt_refits_lora_targets_by_name(adapters, reference, tmp_path):
    """Run-time weights on TensorRT: only they are refittable; a switch refits them, unloading refits the kept
    base values (never a subtraction, TensorRT issue 3628)."""
    fast = kasoku.compile(tiny_pipeline(), "tensorrt", cache_dir=tmp_path, components=TXT2IMG,
                          lora_targets="attention")
    base_unet = unet_outputs_on_host(fast)
    fast.load_lora_weights(str(adapters["a"]), adapter_name="a")
    reference.load_lora_weights(str(adapters["a"]), adapter_name="a")
    try:
        assert psnr(image(reference), image(fast)) >= MIN_PSNR
    finally:
        reference.unload_lora_weights()
    fast.unload_lora_weights()
    np.testing.assert_array_equal(unet_outputs_on_host(fast), base_unet)


def unet_outputs_on_host(fast):
    spec = fast.engines["unet"].spec
    return fast.engines["unet"].run(spec.sample_inputs(spec.profile.opt, seed=5))["out_sample"].cpu().numpy()
