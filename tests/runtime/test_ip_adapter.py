"""IP-Adapters on compiled engines: diffusers' `load_ip_adapter` / `set_ip_adapter_scale` / `unload_ip_adapter` and
`ip_adapter_image(_embeds)` on a KasokuPipeline give diffusers' own images from the same generator (plain and Plus,
two at once, per-layer scales, every task, with LoRA and ControlNet); a scale change or a second adapter of the same
kind builds nothing (the cache shows no new entry); unloading gives the base engine's images exactly; bad image
prompts are refused before any engine runs.

The tiny adapters are written once per module (`write_tiny_ip_adapters`); the engines go into the session cache, so
each backend exports each adapter architecture's U-Net once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import kasoku
from kasoku.architectures import ip_adapter
from kasoku.cli import main
from kasoku.core.components import Precision
from kasoku.core.parity import TOLERANCES, psnr
from kasoku.pipeline.kasoku_pipeline import InvalidInput
from kasoku.runtime.image_prompts import IPAdapterError
from kasoku.tools.tiny import IP_ADAPTER_FILES, write_tiny_ip_adapters
from kasoku.tools.tiny import tiny_pipeline as tiny

integration = pytest.mark.integration
MIN_PSNR = TOLERANCES[Precision.FP32].image_psnr_db
PLAIN, PLUS = IP_ADAPTER_FILES["plain"], IP_ADAPTER_FILES["plus"]
CALL = dict(num_inference_steps=3, output_type="np")


def picture(seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(64, 64, 3) * 255).astype("uint8"))


def image(pipe, **kwargs) -> np.ndarray:
    return pipe("a photo of a cat", generator=torch.Generator().manual_seed(0), **CALL, **kwargs).images[0]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapter folders for the tiny SD 1.x U-Net (each a plain and a Plus adapter and an image encoder), and one
    for the tiny SDXL U-Net (another cross-attention width)."""
    root = tmp_path_factory.mktemp("ip")
    write_tiny_ip_adapters(root / "a", tiny().unet, seed=0)
    write_tiny_ip_adapters(root / "b", tiny().unet, seed=5)
    write_tiny_ip_adapters(root / "xl", tiny(family="sdxl").unet, seed=0)
    return root


def reference(adapters, weight_name, scale=1.0, folders=("a",), pipe=None):
    """diffusers' own pipeline with the adapters loaded as ours are (a folder after another keeps the first image
    encoder, as diffusers does)."""
    pipe = pipe or tiny()
    for folder in folders:
        pipe.load_ip_adapter(str(adapters / folder), subfolder="", weight_name=weight_name)
    pipe.set_ip_adapter_scale(scale)
    return pipe


@pytest.fixture(scope="module", params=["onnxruntime", "openvino"])
def ours(request, tiny_cache):
    pipe = kasoku.compile(tiny(), request.param, cache_dir=tiny_cache.root)
    yield pipe
    pipe.unload_ip_adapter()


def entries(cache) -> set[str]:
    return {entry.key for entry in cache.list()}


@integration
@pytest.mark.parametrize("kind", ["plain", pytest.param("plus", marks=pytest.mark.slow(
    reason="the Plus kind (the plain one stays; the Plus one is also in the scale test)"))])
def test_each_kind_matches_diffusers_and_unloading_gives_the_base_images_exactly(ours, adapters, kind):
    base = image(ours)
    ours.load_ip_adapter(str(adapters / "a"), subfolder="", weight_name=IP_ADAPTER_FILES[kind])
    names = ours.engines["unet"].spec.input_names
    assert names[-2:] == ("ip_embeds_0", ip_adapter.IP_SCALE) and ip_adapter.IMAGE_ENCODER in ours.engines
    expected = image(reference(adapters, IP_ADAPTER_FILES[kind]), ip_adapter_image=picture(1))
    got = image(ours, ip_adapter_image=picture(1))
    assert psnr(expected, got) >= MIN_PSNR
    assert psnr(got, base) < 30  # the image prompt changes the image
    ours.unload_ip_adapter()
    assert ip_adapter.IMAGE_ENCODER not in ours.engines
    np.testing.assert_array_equal(image(ours), base)


@integration
def test_two_adapters_per_layer_scales_and_scale_changes_build_nothing(adapters, tiny_cache):
    ours = kasoku.compile(tiny(), "onnxruntime", cache_dir=tiny_cache.root)
    both = [PLAIN, PLUS]
    ours.load_ip_adapter(str(adapters / "a"), subfolder="", weight_name=both)
    assert ours.engines["unet"].spec.input_names[-3:] == ("ip_embeds_0", "ip_embeds_1", ip_adapter.IP_SCALE)
    diffusers_pipe = reference(adapters, both, [1.0, 1.0])
    built = entries(tiny_cache)
    images = []
    for scale in ([0.5, 0.8], [{"down": {"block_1": [0.0]}, "up": 1.0}, 0.3]):
        ours.set_ip_adapter_scale(scale)
        diffusers_pipe.set_ip_adapter_scale(scale)
        prompts = [picture(1), picture(2)]
        images.append(image(ours, ip_adapter_image=prompts))
        assert psnr(image(diffusers_pipe, ip_adapter_image=prompts), images[-1]) >= MIN_PSNR
    assert entries(tiny_cache) == built
    assert psnr(*images) < 30
    ours.unload_ip_adapter()


@integration
def test_a_second_adapter_of_the_same_kind_binds_its_weights_into_the_same_engine(adapters, tiny_cache):
    ours = kasoku.compile(tiny(), "openvino", cache_dir=tiny_cache.root)
    ours.load_ip_adapter(str(adapters / "a"), subfolder="", weight_name=PLUS)
    first = image(ours, ip_adapter_image=picture(1))
    built = entries(tiny_cache)
    ours.load_ip_adapter(str(adapters / "b"), subfolder="", weight_name=PLUS)
    assert entries(tiny_cache) == built  # no graph, no engine: the adapter's weights are inputs
    second = image(ours, ip_adapter_image=picture(1))
    expected = image(reference(adapters, PLUS, folders=("a", "b")), ip_adapter_image=picture(1))
    assert psnr(expected, second) >= MIN_PSNR and psnr(first, second) < 30
    ours.unload_ip_adapter()


@integration
def test_embeds_every_task_and_the_engines_inputs(tiny_cache, adapters):
    ours = kasoku.compile(tiny(), "onnxruntime", cache_dir=tiny_cache.root)
    ours.load_ip_adapter(str(adapters / "a"), subfolder="", weight_name=PLUS)
    ours.set_ip_adapter_scale(0.7)
    theirs = reference(adapters, PLUS, 0.7)
    embeds = ours.prepare_ip_adapter_image_embeds(picture(1), None, None, 1, True)
    assert [tuple(e.shape) for e in embeds] == [(2, 1, 50, 32)]  # negative and positive, one image, CLIP's tokens
    np.testing.assert_array_equal(image(ours, ip_adapter_image_embeds=embeds), image(ours, ip_adapter_image=picture(1)))
    init, mask = picture(3), Image.fromarray(np.tile((np.arange(64) > 32)[None, :, None] * 255, (64, 1, 3))
                                             .astype("uint8"))
    import diffusers

    for task, extra, cls in (("img2img", dict(image=init, strength=0.7), diffusers.StableDiffusionImg2ImgPipeline),
                             ("inpaint", dict(image=init, mask_image=mask), diffusers.StableDiffusionInpaintPipeline)):
        expected = image(cls.from_pipe(theirs), ip_adapter_image=picture(1), **extra)
        assert psnr(expected, image(ours, ip_adapter_image=picture(1), **extra)) >= MIN_PSNR, task


# ---- bad input: one clear line, before any engine runs ----------------------------------------------------


@integration
def test_bad_image_prompts_are_refused_first(tiny_kasoku, adapters, tmp_path):
    pipe = tiny_kasoku
    with pytest.raises(InvalidInput, match="no IP-Adapter is loaded"):
        pipe("a cat", ip_adapter_image=picture(1))
    with pytest.raises(IPAdapterError, match="does not exist"):
        pipe.load_ip_adapter(str(tmp_path / "none"), subfolder="", weight_name=PLAIN)
    with pytest.raises(IPAdapterError, match="weight_name"):
        pipe.load_ip_adapter(str(adapters / "a"), subfolder="", weight_name="ip-adapter_sd15.safetensors")
    with pytest.raises(IPAdapterError, match="cannot load the IP-Adapter"):  # an SDXL adapter on an SD 1.x U-Net
        pipe.load_ip_adapter(str(adapters / "xl"), subfolder="", weight_name=PLAIN)
    assert not pipe.family.ip_adapters(pipe.model)  # the failed loads left nothing loaded
    with pytest.raises(IPAdapterError, match="no IP-Adapter is loaded"):
        pipe.set_ip_adapter_scale(0.5)
    pipe.load_ip_adapter(str(adapters / "a"), subfolder="", weight_name=PLAIN)
    try:
        with pytest.raises(IPAdapterError, match="one value .* per IP-Adapter: 1 adapter"):
            pipe.set_ip_adapter_scale([0.5, 0.5])
        cases = [
            ({}, "give `ip_adapter_image`"),
            ({"ip_adapter_image": [picture(1), picture(2)]}, "one image per IP-Adapter: 1 loaded but 2"),
            ({"ip_adapter_image": [[picture(1), picture(2)]]}, "gives 2 images to IP-Adapter 1"),
            ({"ip_adapter_image": str(tmp_path / "cat.png")}, "open it first"),
            ({"ip_adapter_image_embeds": [torch.zeros(2, 1, 7)]}, r"has shape \(2, 1, 7\)"),
            ({"ip_adapter_image": picture(1), "cache_interval": 2}, "step caching"),
        ]
        for kwargs, message in cases:
            pipe.times.reset()
            with pytest.raises(InvalidInput, match=message):
                pipe("a cat", num_inference_steps=2, **kwargs)
            assert not pipe.times.calls  # refused before any engine ran
    finally:
        pipe.unload_ip_adapter()


def test_an_unsupported_kind_is_named(adapters):
    from diffusers.models.embeddings import IPAdapterFullImageProjection, MultiIPAdapterImageProjection

    unet = tiny().unet
    unet.encoder_hid_proj = MultiIPAdapterImageProjection([IPAdapterFullImageProjection(32, 32)])
    unet.config.encoder_hid_dim_type = "ip_image_proj"
    with pytest.raises(ip_adapter.UnsupportedIPAdapter, match="plain and Plus"):
        ip_adapter.adapter_kinds(unet)


def test_tiny_writes_adapters_diffusers_loads(tmp_path):
    assert main(["tiny", str(tmp_path / "m"), "--ip-adapter"]) == 0
    folder = tmp_path / "m" / "ip_adapter"
    assert {p.name for p in folder.iterdir()} == {"image_encoder", PLAIN, PLUS}
    pipe = tiny()
    pipe.load_ip_adapter(str(folder), subfolder="", weight_name=[PLAIN, PLUS])
    assert ip_adapter.adapter_kinds(pipe.unet) == ("plain", "plus")


@pytest.mark.parametrize("flags, message", [
    (["--ip-image", "{img}"], "--ip-image needs --ip-adapter"),
    (["--ip-adapter", "{dir}/none.safetensors", "--ip-image", "{img}"], "does not exist"),
    (["--ip-adapter", "{dir}/image_encoder/config.json", "--ip-image", "{img}"], "not a .safetensors"),
    (["--ip-adapter", "{dir}/" + PLAIN], "one --ip-image per --ip-adapter"),
    (["--ip-adapter", "{dir}/" + PLAIN, "--ip-image", "{dir}/none.png"], "--ip-image .* does not exist"),
    (["--ip-adapter", "{dir}/" + PLAIN, "--ip-image", "{img}", "--ip-scale", "1", "--ip-scale", "2",
      "--ip-scale", "3"], "one --ip-scale for every adapter"),
    (["--ip-adapter", "{dir}/" + PLAIN, "--ip-image", "{img}", "--ip-image-encoder", "{dir}"], "no image encoder"),
])
def test_generate_refuses_bad_ip_flags_before_any_work(flags, message, tiny_dir, adapters, tmp_path, capsys):
    picture(1).save(tmp_path / "ip.png")
    filled = [f.format(dir=adapters / "a", img=tmp_path / "ip.png") for f in flags]
    assert main(["generate", str(tiny_dir), "a cat", "-o", str(tmp_path / "out.png"), *filled]) != 0
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert len(err.strip().splitlines()) == 1 and __import__("re").search(message, err), err
    assert not (tmp_path / "out.png").exists()


@integration
def test_generate_with_an_image_prompt(tiny_dir, tiny_cache, adapters, tmp_path):
    picture(1).save(tmp_path / "ip.png")
    out = tmp_path / "out.png"
    assert main(["generate", str(tiny_dir), "a photo of a cat", "-o", str(out), "--steps", "3", "--backend",
                 "onnxruntime", "--cache-dir", str(tiny_cache.root), "--ip-adapter", str(adapters / "a" / PLUS),
                 "--ip-image", str(tmp_path / "ip.png"), "--ip-scale", "0.6"]) == 0
    theirs = reference(adapters, PLUS, 0.6)
    expected = theirs("a photo of a cat", num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                      ip_adapter_image=Image.open(tmp_path / "ip.png").convert("RGB"), output_type="np").images[0]
    assert psnr(expected, np.asarray(Image.open(out), dtype=np.float32) / 255) >= MIN_PSNR  # its 8-bit PNG


@integration
def test_batch_jobs_with_image_prompts(tiny_dir, tiny_cache, adapters, tmp_path):
    import json
    from dataclasses import replace

    from kasoku.batch import plan_batches, prepare, read_jobs, run_local

    picture(1).save(tmp_path / "one.png")
    picture(2).save(tmp_path / "two.png")
    plus = str(adapters / "a" / PLUS)
    lines = [{"prompt": "a photo of a cat", "id": "base", "steps": 3, "seed": 0},
             {"prompt": "a photo of a cat", "id": "one", "steps": 3, "seed": 0, "ip_adapter": plus,
              "ip_image": "one.png", "ip_scale": 0.6},
             {"prompt": "a photo of a dog", "id": "one-dog", "steps": 3, "seed": 1, "ip_adapter": plus,
              "ip_image": "one.png", "ip_scale": 0.6},
             {"prompt": "a photo of a cat", "id": "two", "steps": 3, "seed": 0, "ip_adapter": [plus],
              "ip_image": ["two.png"], "ip_scale": [0.6]}]
    (tmp_path / "jobs.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    jobs = read_jobs(tmp_path / "jobs.jsonl")
    assert [[j.id for j in batch] for batch in plan_batches(jobs, 4)] == [["base"], ["one", "one-dog"], ["two"]]
    plan = prepare(tiny_dir, jobs, tmp_path / "out", batch_size=4, backend="onnxruntime", cache_dir=tiny_cache.root)
    plan.recipe = replace(plan.recipe, options=plan.recipe.options.replace(profile=None))  # the cached engines
    assert run_local(plan).generated == 4
    theirs = reference(adapters, PLUS, 0.6)
    for job in ("one", "two"):
        expected = image(theirs, ip_adapter_image=Image.open(tmp_path / f"{job}.png").convert("RGB"))
        got = np.asarray(Image.open(tmp_path / "out" / f"{job}.png"), np.float32) / 255
        assert psnr(expected, got) >= MIN_PSNR, job


@pytest.mark.parametrize("line, message", [
    ({"ip_image": "one.png"}, "`ip_image` needs `ip_adapter`"),
    ({"ip_adapter": "none.safetensors", "ip_image": "one.png"}, "does not exist"),
    ({"ip_adapter": "{plain}"}, "one image per IP-Adapter: 1 adapter"),
    ({"ip_adapter": "{plain}", "ip_image": "one.png", "ip_scale": [1, 2]}, "`ip_scale` must be"),
    ({"ip_adapter": "{plain}", "ip_image": "jobs.jsonl"}, "not an image"),
])
def test_bad_image_prompt_jobs_are_refused_before_any_work(line, message, adapters, tmp_path):
    import json

    from kasoku.batch import InvalidJobs, read_jobs

    picture(1).save(tmp_path / "one.png")
    record = {"prompt": "a cat", **{k: (v.format(plain=adapters / "a" / PLAIN) if isinstance(v, str) else v)
                                    for k, v in line.items()}}
    (tmp_path / "jobs.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(InvalidJobs, match=message):
        read_jobs(tmp_path / "jobs.jsonl")


@integration
def test_serve_takes_image_prompts_in_generations_and_edits(tiny_dir, tiny_cache, adapters):
    """`kasoku serve --ip-adapter FILE`: `ip_image` (base64 in JSON, a file in edits) and `ip_scale` give diffusers'
    image; a request without an image prompt runs the adapter at scale 0 (the U-Net's own result)."""
    pytest.importorskip("fastapi")
    import base64
    import io

    from fastapi.testclient import TestClient

    from kasoku.core.options import CompileOptions
    from kasoku.serve import ImageService, prepare_serving
    from kasoku.serve.app import create_app
    from kasoku.serve.config import Size

    config, model = prepare_serving(str(tiny_dir), CompileOptions(backend="onnxruntime", cache_dir=tiny_cache.root),
                                    sizes=(Size(64, 64),), max_batch=2, ip_adapter=str(adapters / "a" / PLUS))
    service = ImageService(config)
    service.load(model)
    png = io.BytesIO()
    picture(1).save(png, format="PNG")

    def decoded(answer):
        assert answer.status_code == 200, answer.text
        data = base64.b64decode(answer.json()["data"][0]["b64_json"])
        return np.asarray(Image.open(io.BytesIO(data)), np.float32) / 255

    fields = {"prompt": "a photo of a cat", "steps": 3, "seed": 0}
    with TestClient(create_app(service)) as client:
        prompted = decoded(client.post("/v1/images/generations", json={
            **fields, "ip_image": base64.b64encode(png.getvalue()).decode(), "ip_scale": 0.6}))
        plain = decoded(client.post("/v1/images/generations", json=fields))
        uploads = {"image": ("in.png", png.getvalue()), "ip_image": ("ip.png", png.getvalue())}
        edited = decoded(client.post("/v1/images/edits", data={**fields, "strength": "0.7", "ip_scale": "0.6"},
                                     files=uploads))
        bad = client.post("/v1/images/generations", json={**fields, "ip_image": "not base64!"})
        assert bad.status_code == 400 and "base64" in bad.json()["error"]["message"]
    theirs = reference(adapters, PLUS, 0.6)
    assert psnr(image(theirs, ip_adapter_image=picture(1)), prompted) >= MIN_PSNR
    assert psnr(image(tiny()), plain) >= MIN_PSNR
    import diffusers

    expected = image(diffusers.StableDiffusionImg2ImgPipeline.from_pipe(theirs), image=picture(1), strength=0.7,
                     ip_adapter_image=picture(1))
    assert psnr(expected, edited) >= MIN_PSNR


@integration
@pytest.mark.slow  # AOTInductor compiles: minutes of C++ on two cores
def test_inductor_holds_the_adapter_as_constants_and_matches_diffusers(adapters, tmp_path):
    ours = kasoku.compile(tiny(), "inductor", cache_dir=tmp_path, components=("text_encoder", "unet", "vae_decoder"))
    ours.load_ip_adapter(str(adapters / "a"), subfolder="", weight_name=PLAIN)
    assert ours.engines["unet"].bound == {} and ours.engines[ip_adapter.IMAGE_ENCODER].backend == "inductor"
    expected = image(reference(adapters, PLAIN), ip_adapter_image=picture(1))
    assert psnr(expected, image(ours, ip_adapter_image=picture(1))) >= MIN_PSNR


@integration
def test_verify_checks_the_image_encoder_and_an_image_with_an_image_prompt(tiny_dir, tiny_cache, adapters):
    from kasoku.tools.verification import verify

    report = verify(str(tiny_dir), "onnxruntime", cache_dir=tiny_cache.root, ip_adapter=[adapters / "a" / PLUS])
    checked = {c.component for c in report.components}
    assert {ip_adapter.IMAGE_ENCODER, "unet"} <= checked and report.passed, report.to_dict()
    assert report.image.psnr_db >= MIN_PSNR
