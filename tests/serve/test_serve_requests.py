"""kasoku serve without engines (unit tier): request fields and their errors, the dynamic batcher's
queue, grouping, limits and deadlines, and the profile a server compiles for. The servers
themselves, on real engines, are tests/serve/test_serve.py."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import time

import pytest
from PIL import Image

from kasoku.batch.jobs import plan_batches
from kasoku.core.components import ImageShape
from kasoku.core.options import CompileOptions
from kasoku.families import FAMILIES
from kasoku.serve.config import ServeConfig, Size, prepare_serving
from kasoku.serve.errors import InvalidRequest, QueueFull, TimedOut
from kasoku.serve.fields import mask_from, parse_edit, parse_generation

CONFIG = ServeConfig(model="/models/tiny-sd", model_name="tiny-sd", options=CompileOptions(),
                     sizes=(Size(64, 64), Size(96, 64)), max_batch=4, max_queue=8,
                     cache_methods=FAMILIES["sd1"].cache_methods)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# ---- fields ------------------------------------------------------------------------------------


def test_a_generation_becomes_one_job_per_image_each_with_its_seed():
    request = parse_generation({"prompt": "a cat", "n": 3, "size": "96x64", "seed": 7, "steps": 5,
                                "guidance": 1, "negative_prompt": "blurry", "model": "tiny-sd"}, CONFIG)
    jobs = request.jobs()
    assert [job.seed for job in jobs] == [7, 8, 9]
    assert {(job.width, job.height, job.steps, job.guidance, job.negative_prompt) for job in jobs} == \
        {(96, 64, 5, 1.0, "blurry")}
    assert len({job.call_key for job in jobs}) == 1  # one request's images can share a call
    default = parse_generation({"prompt": "a cat", "size": "auto"}, CONFIG)
    assert default.size == Size(64, 64) and default.steps == 30 and default.guidance == 7.5 and default.n == 1
    assert 0 <= default.seed < 2**32  # drawn, and told back in the answer


@pytest.mark.parametrize("body, message", [
    ({}, "`prompt` must be a string but is null"),
    ({"prompt": 5}, "`prompt` must be a string but is 5"),
    ({"prompt": "x", "size": "13x13"}, "Start `kasoku serve` with --size WxH to serve another (width and height "
                                       "multiples of"),  # not a --size the server would refuse
    ({"prompt": "x", "size": "64x96"}, "`size` must be one of the sizes this server's engines serve (64x64, 96x64"),
    ({"prompt": "x", "n": 9}, "`n` must be an integer in 1..8"),  # --max-queue 8 holds at most 8
    ({"prompt": "x", "n": True}, "`n` must be an integer in 1..8 but is true"),
    ({"prompt": "x", "steps": 1001}, "`steps` must be an integer in 1..1000 but is 1001"),
    ({"prompt": "x", "guidance": float("nan")}, "`guidance` must be a finite number"),
    ({"prompt": "x", "seed": 2**63 - 1, "n": 2}, "`seed` must be an integer in 0..9223372036854775806"),
    ({"prompt": "x", "model": "dall-e-2"}, "`model` must be 'tiny-sd'"),
    ({"prompt": "x", "response_format": "url"}, "`response_format` must be \"b64_json\""),
    ({"prompt": "x", "style": "pastel"}, "`style` must be one of vivid, natural but is \"pastel\""),
    ({"prompt": "x", "quality": "ultra"}, "`quality` must be one of low, medium, standard, auto, high, hd"),
    ({"prompt": "x", "loras": ["style"]}, "`loras`: this server was started without LoRA adapters; start it with "
                                          "`kasoku serve ... --lora NAME=PATH`"),
    ({"prompt": "x", "loras": "style"}, '`loras` must be a list of "NAME[:SCALE]" strings'),
    ({"prompt": "x", "cache_interval": 3}, "`cache_interval` (deepcache interval 3 (uniform)) needs the step-cache "
                                           "engines, which this server did not build; start it with `kasoku serve ... "
                                           "--step-cache`"),
    ({"prompt": "x", "cache_threshold": 0.1}, "`cache_method` 'first-block': this denoiser runs deepcache, "
                                              "taylorseer"),
    ({"prompt": "x", "cache_method": "fast"}, "`cache_method` must be one of deepcache, taylorseer, first-block"),
    ({"prompt": "x", "cache_interval": 0}, "`cache_interval` must be an integer in 1..1000 but is 0"),
    ({"prompt": "x", "strength": 0.5}, "`strength` belongs to /v1/images/edits"),
    (["a cat"], "the body must be a JSON object but is list"),
])
def test_bad_generation_fields_say_what_is_wrong(body, message):
    with pytest.raises(InvalidRequest) as caught:
        parse_generation(body, CONFIG)
    assert message in str(caught.value)
    assert caught.value.status == 400 and caught.value.body()["error"]["type"] == "invalid_request_error"


def test_an_empty_prompt_is_a_prompt_as_in_diffusers_the_cli_and_python():
    assert parse_generation({"prompt": ""}, CONFIG).prompt == ""


def test_an_edit_reads_its_form_text_and_resizes_image_and_mask_to_the_size():
    picture = png(Image.new("RGB", (128, 128), (200, 10, 10)))
    rgba = Image.new("RGBA", (128, 128), (0, 0, 0, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 64, 128))  # left half transparent: paint there (OpenAI's rule)
    request = parse_edit({"prompt": "a dog", "n": "2", "seed": "3", "strength": "0.5", "size": "96x64"}, picture,
                         png(rgba), CONFIG)
    assert request.task == "inpaint" and request.n == 2 and request.strength == 0.5 and request.seeds == [3, 4]
    assert request.image.size == (96, 64) and request.mask.size == (96, 64)
    assert request.mask.getpixel((10, 30)) == 255 and request.mask.getpixel((90, 30)) == 0
    plain = parse_edit({"prompt": "a dog"}, picture, None, CONFIG)
    assert plain.task == "img2img" and plain.strength == 0.8 and plain.mask is None
    assert plain.jobs()[0].call_key != request.jobs()[0].call_key


def test_a_mask_without_transparency_is_white_where_to_paint():
    grey = Image.new("L", (8, 8), 0)
    grey.putpixel((1, 1), 255)
    mask = mask_from(grey)
    assert mask.getpixel((1, 1)) == 255 and mask.getpixel((0, 0)) == 0


@pytest.mark.parametrize("form, image, mask, message", [
    ({"prompt": "x"}, None, None, "`image` is missing"),
    ({"prompt": "x"}, b"GIF89a-truncated", None, "`image` is not an image"),
    ({"prompt": "x", "strength": "lots"}, "ok", None, "`strength` must be a number in [0, 1] but is \"lots\""),
    ({"prompt": "x", "n": "two"}, "ok", None, "`n` must be an integer in 1..8 but is \"two\""),
    ({"prompt": "x"}, "ok", "small", "`mask` must be the size of `image` (64x64) but is 32x32"),
])
def test_bad_edits_say_what_is_wrong(form, image, mask, message):
    files = {"ok": png(Image.new("RGB", (64, 64))), "small": png(Image.new("L", (32, 32)))}
    with pytest.raises(InvalidRequest) as caught:
        parse_edit(form, files.get(image, image), files.get(mask, mask), CONFIG)
    assert message in str(caught.value)


# ---- the batcher ---------------------------------------------------------------------------------


class Recorder:
    """The batcher's `run`: records each call's seeds and answers each image with its seed."""

    def __init__(self, seconds: float = 0.0):
        self.calls: list[list[int]] = []
        self.seconds = seconds

    def __call__(self, jobs, wanted):
        self.calls.append([job.seed for job in jobs])
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            if not wanted():
                from kasoku.serve.batching import CallAbandoned

                raise CallAbandoned()
            time.sleep(0.005)
        return [job.seed for job in jobs]


def run(coroutine):
    return asyncio.run(coroutine)


async def _with_batcher(recorder, body, **limits):
    from kasoku.serve.batching import Batcher

    batcher = Batcher(recorder, **{"max_batch": 4, "window_s": 0.05, "max_queue": 16, **limits})
    batcher.start()
    try:
        return await body(batcher)
    finally:
        await batcher.stop(grace_s=5)


def requests_of(*bodies):
    return [parse_generation({"prompt": "x", "steps": 2, **body}, CONFIG) for body in bodies]


def test_requests_in_one_window_share_calls_grouped_like_kasoku_batch():
    bodies = [{"seed": 10 * i, "n": 1 + i % 2, "guidance": 7.5 if i % 3 else 1.0} for i in range(6)]
    recorder = Recorder()

    async def body(batcher):
        far = time.monotonic() + 30
        return await asyncio.gather(*(batcher.submit(r.jobs(), far) for r in requests_of(*bodies)))

    answers = run(_with_batcher(recorder, body))
    assert answers == [r.seeds for r in requests_of(*bodies)]  # each request its own images, in order
    jobs = [job for r in requests_of(*bodies) for job in r.jobs()]
    assert recorder.calls == [[job.seed for job in call] for call in plan_batches(jobs, 4)]
    assert sorted(seed for call in recorder.calls for seed in call) == sorted(job.seed for job in jobs)


def test_a_full_queue_refuses_at_once_with_retry_after():
    recorder = Recorder(seconds=0.3)

    async def body(batcher):
        far = time.monotonic() + 30
        first = asyncio.ensure_future(batcher.submit(requests_of({"seed": 1})[0].jobs(), far))
        await asyncio.sleep(0.1)  # running now, the queue empty
        second = asyncio.ensure_future(batcher.submit(requests_of({"seed": 2, "n": 2})[0].jobs(), far))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull) as caught:
            await batcher.submit(requests_of({"seed": 3})[0].jobs(), far)
        assert caught.value.status == 429 and int(caught.value.headers["Retry-After"]) >= 1
        return await first, await second

    assert run(_with_batcher(recorder, body, max_queue=2, max_batch=1)) == ([1], [2, 3])
    assert recorder.calls == [[1], [2], [3]]


def test_past_its_deadline_a_request_leaves_the_queue_and_its_call_stops():
    recorder = Recorder(seconds=5)

    async def body(batcher):
        start = time.monotonic()
        running = asyncio.ensure_future(batcher.submit(requests_of({"seed": 1})[0].jobs(), start + 0.3))
        queued = asyncio.ensure_future(batcher.submit(requests_of({"seed": 2})[0].jobs(), start + 0.2))
        for waiting in (running, queued):
            with pytest.raises(TimedOut):
                await waiting
        assert time.monotonic() - start < 2, "the 5 s call stopped once nobody waited for it"
        return batcher.depth

    assert run(_with_batcher(recorder, body, max_batch=1)) == 0
    assert recorder.calls == [[1]], "the queued request never ran"


# ---- what a server compiles for ------------------------------------------------------------------


def test_a_server_compiles_exactly_its_sizes_for_one_to_max_batch_images(tiny_dir, tmp_path):
    config, _ = prepare_serving(tiny_dir, CompileOptions(backend="onnxruntime", cache_dir=tmp_path / "empty"),
                                sizes=(Size(64, 64),), max_batch=3)
    profile = config.options.profile
    assert (profile.min, profile.max) == (ImageShape(1, 64, 64), ImageShape(3, 64, 64))
    assert profile.guidance is None  # a request's guidance decides
    assert config.options.components == ("text_encoder", "unet", "vae_decoder", "vae_encoder")  # edits too
    assert config.model_name == "tiny-sd" and config.max_steps == 999
    several, _ = prepare_serving(tiny_dir, CompileOptions(cache_dir=tmp_path / "empty"),
                                 sizes=(Size(96, 64), Size(64, 128)))
    assert several.options.profile.min.height == 64 and several.options.profile.max.height == 128
    assert several.default_size == Size(96, 64)


@pytest.mark.skipif(importlib.util.find_spec("fastapi") is None, reason="pip install 'kasoku[serve]'")
def test_a_port_in_use_is_one_clear_error():
    import socket

    from kasoku.serve.server import PortUnavailable, bind

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(PortUnavailable, match=r"cannot listen on 127\.0\.0\.1:\d+ .*choose another --port"):
            bind("127.0.0.1", taken.getsockname()[1])


def test_a_missing_server_stack_names_the_extra(monkeypatch):
    from kasoku.serve import config

    monkeypatch.setitem(config.SERVE_MODULES, "an-absent-package", ("kasoku_no_such_module",))
    with pytest.raises(config.ServeNotInstalled, match=r"needs an-absent-package, .*pip install 'kasoku\[serve\]'"):
        config.require_serve()


def test_openai_quality_sets_the_steps_and_style_is_taken():
    steps = {q: parse_generation({"prompt": "x", "quality": q}, CONFIG).steps for q in ("low", "auto", "hd")}
    assert steps == {"low": 15, "auto": 30, "hd": 45}  # of the model's 30
    assert parse_generation({"prompt": "x", "quality": "low", "steps": 7}, CONFIG).steps == 7  # its own steps win
    assert parse_generation({"prompt": "x", "style": "natural"}, CONFIG).steps == 30


def test_step_caching_requests_need_a_server_built_with_its_engines():
    config = CONFIG.replace(options=CompileOptions(step_cache=True))
    cached = parse_generation({"prompt": "x", "cache_interval": 3, "cache_schedule": "nonuniform"}, config)
    plain = parse_generation({"prompt": "x"}, config)
    assert (cached.cache_interval, cached.cache_schedule) == (3, "nonuniform")
    assert cached.call_arguments(1)["cache_interval"] == 3
    assert cached.jobs()[0].call_key != plain.jobs()[0].call_key  # never in one call with uncached images


LORA_CONFIG = CONFIG.replace(loras=(("style", "/adapters/style"), ("ink", "/adapters/ink")))


def test_lora_requests_name_the_servers_adapters_each_at_a_scale():
    request = parse_generation({"prompt": "x", "n": 2, "loras": ["style:0.5", {"name": "ink"}]}, LORA_CONFIG)
    assert request.loras == (("/adapters/style", 0.5), ("/adapters/ink", 1.0))
    plain = parse_generation({"prompt": "x"}, LORA_CONFIG)
    assert len({job.call_key for job in request.jobs()}) == 1  # one request's images share a call
    assert request.jobs()[0].call_key != plain.jobs()[0].call_key  # never in one call with other adapters
    edit = parse_edit({"prompt": "x", "loras": "style:0.5, ink"}, png(Image.new("RGB", (64, 64))), None,
                      LORA_CONFIG)  # a form's text: comma-separated
    assert edit.loras == request.loras


@pytest.mark.parametrize("loras, message", [
    (["paint"], '`loras`: no adapter named "paint" on this server; it serves style, ink'),
    (["style:strong"], '`loras` must be a list of "NAME[:SCALE]" strings or {"name": ..., "scale": ...} objects but '
                       'is "style:strong"'),
    ([{"name": "style", "scale": float("inf")}], "`loras` must be scales that are finite numbers"),
    ([{"path": "/etc/passwd"}], '`loras` must be a list of "NAME[:SCALE]"'),  # files are the server's to choose
    (["style", "style:0.5"], "`loras` names style twice"),
])
def test_bad_lora_requests_say_what_is_wrong(loras, message):
    with pytest.raises(InvalidRequest) as caught:
        parse_generation({"prompt": "x", "loras": loras}, LORA_CONFIG)
    assert message in str(caught.value) and caught.value.body()["error"]["param"] == "loras"


def test_serve_lora_names_and_files_are_checked_before_anything_starts(tiny_dir, tmp_path):
    from kasoku.core.errors import KasokuError

    with pytest.raises(KasokuError, match="an adapter's name is letters, digits"):
        prepare_serving(tiny_dir, loras=(("my style", str(tmp_path)),))
    with pytest.raises(KasokuError, match=r"--lora .*missing does not exist"):
        prepare_serving(tiny_dir, loras=(("style", str(tmp_path / "missing")),))
