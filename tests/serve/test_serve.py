"""kasoku serve on the tiny pipeline: real servers on 127.0.0.1 (`kasoku serve` in a subprocess),
spoken to with the official `openai` client; their images checked against KasokuPipeline byte for
byte; batching, limits, errors, metrics, graceful shutdown, Ray Serve and the web page in Chromium."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = [
    pytest.mark.integration,  # builds engines, runs servers and Ray
    pytest.mark.skipif(importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None,
                       reason="the server stack is not installed: pip install 'kasoku[serve]' (`make setup` does)"),
]
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install 'kasoku[dev]'")

STEPS = 4
PROMPT = "a photo of a cat"
KEY_VARIABLE = "KASOKU_TEST_SERVE_KEY"
KEY = "test-key-17"
# PNDM (the tiny model's scheduler) cannot run exactly its 1000 training steps (diffusers indexes past its table)
LONG_STEPS = 999
BUSY_TIMEOUT = 4.0  # seconds: long enough to fill the queue on a loaded machine, far below a 1000-step request
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
# Debian's chromium as root, headless, on a machine with no network (Chromium's own background traffic off)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class Server:
    """`kasoku serve` in a subprocess, its output in a file; ready once /readyz answers 200."""

    def __init__(self, folder: Path, model: Path, cache: Path, *args: str, key: bool = False, ray: bool = False):
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "serve.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", KEY_VARIABLE: KEY}
        command = [sys.executable, "-m", "kasoku.cli", "serve", str(model), "--backend", "onnxruntime",
                   "--cache-dir", str(cache), "--log-level", "warning", *args]
        if key:
            command += ["--api-key-env", KEY_VARIABLE]
        if not ray:
            command += ["--port", "0"]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_for(r"(?:listening on|ready on Ray Serve at) (http://[\d.]+:\d+)", 240)
        self._wait_until_ready(240)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def _wait_for(self, pattern: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output())
            if match:
                return match[1]
            if self.process.poll() is not None:
                pytest.fail(f"kasoku serve exited with {self.process.returncode}:\n{self.output()}")
            time.sleep(0.2)
        pytest.fail(f"kasoku serve did not print {pattern!r} within {seconds} s:\n{self.output()}")

    def _wait_until_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if self.get("/readyz")[0] == 200:
                    return
            if self.process.poll() is not None:
                pytest.fail(f"kasoku serve exited with {self.process.returncode}:\n{self.output()}")
            time.sleep(0.2)
        pytest.fail(f"kasoku serve was not ready within {seconds} s:\n{self.output()}")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def ready(self) -> dict:
        status, body = self.get("/readyz")
        assert status == 200, body
        return json.loads(body)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics: {"name{label=value,...}": value}."""
        from prometheus_client.parser import text_string_to_metric_families

        status, body = self.get("/metrics")
        assert status == 200
        samples = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def client(self, key: str | None = KEY, timeout: float = 60):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=timeout)

    def wait_for_metric(self, name: str, check, seconds: float = 30) -> None:
        self.wait_for_metrics(lambda metrics: check(metrics.get(name, 0.0)), seconds)

    def wait_for_metrics(self, check, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if check(self.metrics()):
                return
            time.sleep(0.02)
        pytest.fail(f"the metrics never reached the expected values: {self.metrics()}")

    def stop(self, seconds: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"kasoku serve did not exit within {seconds} s of SIGTERM:\n{self.output()}")


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def cache_root(tiny_dir, tiny_cache):
    """The tiny pipeline's ONNX Runtime engines for its default profile, compiled once: every server
    here serves 64x64 from them (engines in the cache that serve the size are used, not rebuilt);
    the other test modules' `tiny_compiled` shares the same entries."""
    from kasoku.pipeline.compiling import compile_components

    compile_components(tiny_dir, backend="onnxruntime", cache=tiny_cache)
    return tiny_cache.root


@pytest.fixture(scope="module")
def server(tiny_dir, cache_root, tmp_path_factory):
    """The main server: batches up to 4 images, asks for an API key."""
    started = Server(tmp_path_factory.mktemp("serve-main"), tiny_dir, cache_root, "--max-batch", "4",
                     "--batch-window-ms", "50", "--size", "64x64", key=True)
    yield started
    assert started.stop() == 0, started.output()


@pytest.fixture(scope="module")
def busy_server(tiny_dir, cache_root, tmp_path_factory):
    """One image per call, a queue of one, a short timeout: the limits are easy to reach. At 128x128, a
    request of LONG_STEPS takes many times the timeout (the default profile's engines serve 32..128)."""
    started = Server(tmp_path_factory.mktemp("serve-busy"), tiny_dir, cache_root, "--max-batch", "1",
                     "--max-queue", "1", "--timeout", str(BUSY_TIMEOUT), "--size", "128x128")
    yield started
    assert started.stop() == 0, started.output()


@pytest.fixture(scope="module")
def reference(server, tiny_dir, cache_root):
    """KasokuPipeline over exactly the server's engines (its profile, from /readyz)."""
    import kasoku
    from kasoku.core.components import ShapeProfile

    profile = ShapeProfile.from_dict(server.ready()["profile"])
    return kasoku.KasokuPipeline.from_pretrained(tiny_dir, options=kasoku.CompileOptions(
        backend="onnxruntime", cache_dir=cache_root, profile=profile))


def seeded(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


# ---- images ------------------------------------------------------------------------------------


def test_two_images_are_kasoku_pipelines_with_the_same_seeds(server, reference):
    answer = server.client().images.generate(prompt=PROMPT, n=2, size="64x64", response_format="b64_json",
                                             extra_body={"seed": 11, "steps": STEPS})
    assert [image.seed for image in answer.data] == [11, 12]  # image i: seed + i
    expected = reference([PROMPT] * 2, generator=seeded(11, 12), num_inference_steps=STEPS, guidance_scale=7.5,
                         height=64, width=64).images
    for image, want in zip(answer.data, expected):
        assert pixels(image.b64_json).tobytes() == np.asarray(want).tobytes()


def test_edits_are_img2img_and_inpaint_of_kasoku_pipeline(server, reference):
    from kasoku.serve.fields import mask_from

    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    client = server.client()
    img2img = client.images.edit(image=("in.png", png(picture), "image/png"), prompt=PROMPT,
                                 extra_body={"seed": 3, "steps": STEPS, "strength": 0.75})
    want = reference([PROMPT], image=[picture], strength=0.75, generator=seeded(3), num_inference_steps=STEPS,
                     guidance_scale=7.5).images[0]
    assert img2img.kasoku["task"] == "img2img"
    assert pixels(img2img.data[0].b64_json).tobytes() == np.asarray(want).tobytes()

    alpha = np.full((64, 64), 255, dtype=np.uint8)
    alpha[16:48, 16:48] = 0  # OpenAI's masks: paint where fully transparent
    mask = Image.fromarray(np.dstack([np.zeros((64, 64, 3), np.uint8), alpha]), "RGBA")
    inpaint = client.images.edit(image=("in.png", png(picture), "image/png"), mask=("mask.png", png(mask), "image/png"),
                                 prompt=PROMPT, extra_body={"seed": 4, "steps": STEPS})
    want = reference([PROMPT], image=[picture], mask_image=[mask_from(mask)], strength=0.8, generator=seeded(4),
                     num_inference_steps=STEPS, guidance_scale=7.5, height=64, width=64).images[0]
    assert inpaint.kasoku["task"] == "inpaint"
    assert pixels(inpaint.data[0].b64_json).tobytes() == np.asarray(want).tobytes()


def test_sixteen_concurrent_requests_each_answered_once_in_shared_calls(server):
    before = server.metrics()
    client = server.client()

    def ask(i: int):
        return client.images.generate(prompt=f"a photo of thing {i}", size="64x64",
                                      extra_body={"seed": 100 + i, "steps": STEPS})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    after = server.metrics()
    assert [[image.seed for image in answer.data] for answer in answers] == [[100 + i] for i in range(16)]
    digests = {hashlib.sha256(pixels(answer.data[0].b64_json).tobytes()).hexdigest() for answer in answers}
    assert len(digests) == 16, "every request got its own image"

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kasoku_serve_images_total") == 16
    assert delta("kasoku_serve_batch_size_sum") == 16, "every image ran in exactly one engine call"
    calls = delta("kasoku_serve_batch_size_count")
    single = delta("kasoku_serve_batch_size_bucket{le=1.0}")
    assert calls - single >= 1 and calls < 16, f"{calls:g} calls, {single:g} of one image: no call was shared"
    assert after["kasoku_serve_queue_depth"] == 0


# ---- errors --------------------------------------------------------------------------------------


BAD_GENERATIONS = [
    (dict(size="60x60"), "`size` must be one of the sizes"),
    (dict(size="huge"), "`size` must be one of the sizes"),
    (dict(n=0), "`n` must be an integer in 1..10"),
    (dict(response_format="url"), "`response_format` must be \"b64_json\""),
    (dict(model="dall-e-3"), "`model` must be"),
    (dict(extra_body={"steps": 0}), "`steps` must be an integer in 1..999"),
    (dict(extra_body={"guidance": "strong"}), "`guidance` must be a finite number"),
    (dict(extra_body={"seed": -1}), "`seed` must be an integer"),
    (dict(extra_body={"strength": 0.5}), "`strength` belongs to /v1/images/edits"),
    (dict(extra_body={"colour": "blue"}), "unknown field `colour`"),
    (dict(extra_body={"cache_interval": 2}), "`cache_interval` (deepcache interval 2 (uniform)) needs the step-cache "
                                             "engines, which this server did not build"),
    (dict(extra_body={"loras": [{"name": "x"}]}), "`loras`: this server was started without LoRA adapters"),
]


def test_bad_requests_are_400_saying_what_is_wrong_and_the_server_goes_on(server):
    client = server.client()
    before = server.metrics().get("kasoku_serve_errors_total{status=400}", 0.0)
    for kwargs, message in BAD_GENERATIONS:
        with pytest.raises(openai.BadRequestError) as caught:
            client.images.generate(prompt=PROMPT, **kwargs)
        assert message in caught.value.message, (kwargs, caught.value.message)
        assert caught.value.body["type"] == "invalid_request_error"
    picture = png(Image.new("RGB", (64, 64)))
    bad_edits = [
        (dict(image=("in.png", b"not an image", "image/png")), "`image` is not an image"),
        (dict(image=("in.png", picture, "image/png"), mask=("m.png", png(Image.new("L", (32, 32))), "image/png")),
         "`mask` must be the size of `image`"),
        (dict(image=("in.png", picture, "image/png"), extra_body={"strength": 2}), "`strength` must be a number in"),
    ]
    for kwargs, message in bad_edits:
        with pytest.raises(openai.BadRequestError) as caught:
            client.images.edit(prompt=PROMPT, **kwargs)
        assert message in caught.value.message, (kwargs, caught.value.message)
    status, body = server.get("/nowhere")
    assert status == 404 and "error" in json.loads(body)
    plain = urllib.request.Request(server.url + "/v1/images/generations", data=b'{"prompt": "a cat"}', method="POST",
                                   headers={"Content-Type": "text/plain", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(plain, timeout=10)
    answer = json.loads(refused.value.read())
    assert refused.value.code == 400 and "`Content-Type: application/json`" in answer["error"]["message"]
    after = server.metrics()["kasoku_serve_errors_total{status=400}"]
    assert after - before == len(BAD_GENERATIONS) + len(bad_edits) + 1
    answer = client.images.generate(prompt=PROMPT, extra_body={"seed": 1, "steps": STEPS})
    assert answer.data[0].seed == 1 and pixels(answer.data[0].b64_json).shape == (64, 64, 3)


def test_without_the_api_key_is_401(server):
    for key in (None, "wrong-key"):
        with pytest.raises(openai.AuthenticationError) as caught:
            server.client(key=key).images.generate(prompt=PROMPT, extra_body={"steps": STEPS})
        assert caught.value.body["code"] == "invalid_api_key"
    assert server.get("/healthz")[0] == 200  # health, readiness, metrics and the page need no key


def _post_json(url: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def test_full_queue_is_429_with_retry_after(busy_server):
    """One call running, one image queued (--max-queue 1): the next request is refused at once. The two
    long ones then pass --timeout and get 504."""
    long = {"prompt": PROMPT, "steps": LONG_STEPS, "seed": 1}
    url = busy_server.url + "/v1/images/generations"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(_post_json, url, long)
        busy_server.wait_for_metric("kasoku_serve_running_images", lambda v: v == 1)
        queued = pool.submit(_post_json, url, long)
        busy_server.wait_for_metric("kasoku_serve_queue_depth", lambda v: v == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            busy_server.client().images.generate(prompt=PROMPT, extra_body={"steps": STEPS})
        assert int(caught.value.response.headers["retry-after"]) >= 1
        assert caught.value.body["code"] == "queue_full"
        assert [running.result()[0], queued.result()[0]] == [504, 504]


def test_past_the_timeout_is_504_and_the_engine_is_freed(busy_server):
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as caught:
        busy_server.client().images.generate(prompt=PROMPT, extra_body={"steps": LONG_STEPS})
    assert caught.value.status_code == 504 and caught.value.body["code"] == "timeout"
    assert time.monotonic() - start < BUSY_TIMEOUT + 3
    # The long call stopped between two steps: a short request right after is answered within the timeout.
    answer = busy_server.client().images.generate(prompt=PROMPT, extra_body={"steps": STEPS, "seed": 2})
    assert answer.data[0].seed == 2
    assert busy_server.metrics()["kasoku_serve_errors_total{status=504}"] >= 1


# ---- lifecycle -----------------------------------------------------------------------------------


def test_sigterm_answers_the_requests_in_flight_then_exits_0(tiny_dir, cache_root, tmp_path):
    server = Server(tmp_path / "serve", tiny_dir, cache_root, "--max-batch", "2")
    client = server.client()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        asked = [pool.submit(client.images.generate, prompt=PROMPT, extra_body={"seed": i, "steps": 100})
                 for i in range(4)]
        server.wait_for_metrics(lambda m: m["kasoku_serve_running_images"] + m["kasoku_serve_queue_depth"] == 4)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
            pass  # no longer listening, while the four are still being answered
        answers = [future.result(timeout=120) for future in asked]
    assert [answer.data[0].seed for answer in answers] == [0, 1, 2, 3]
    assert server.process.wait(60) == 0, server.output()


@pytest.mark.skipif(importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None,
                    reason="Ray Serve is not installed: pip install 'kasoku[serve]' (`make setup` does)")
@pytest.mark.slow  # starts a Ray cluster and two Serve replicas: over a minute on two cores
def test_two_ray_serve_replicas_load_from_the_cache_and_share_the_requests(tiny_dir, cache_root, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = Server(tmp_path / "ray", tiny_dir, cache_root, "--ray", "--replicas", "2", "--port", str(port),
                    ray=True)
    try:
        assert "replicas 2 running" in server.output()
        client = server.client()
        replicas = set()
        for round_ in range(5):  # Ray Serve's router spreads concurrent requests over both replicas
            seeds = [10 * round_ + i for i in range(6)]
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(lambda seed: client.images.generate(
                    prompt=PROMPT, extra_body={"seed": seed, "steps": 20}), seeds))
            assert [answer.data[0].seed for answer in answers] == seeds
            replicas |= {answer.kasoku["replica"] for answer in answers}
            if len(replicas) == 2:
                break
        assert len(replicas) == 2, f"every request went to {replicas}"
        assert server.ready()["engines_built"] == 0, "replicas load engines from the cache, never build them"
    finally:
        code = server.stop(120)
    assert code == 0, server.output()


# ---- the web page --------------------------------------------------------------------------------


def test_web_page_in_headless_chromium(server, tmp_path):
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (`make test` installs Debian's chromium where it can: "
                    "apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is a test dependency: "
                                                                  "pip install 'kasoku[dev]'")
    shot = tmp_path / "serve-page.png"
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 720})
            page.goto(server.url + "/")
            assert page.locator("#api-key").is_visible(), "the server needs a key: the page asks for it"
            page.fill("#prompt", PROMPT)
            page.fill("#steps", str(STEPS))
            page.fill("#seed", "7")
            page.fill("#api-key", KEY)
            # Hold the answer in the page until told, so the progress indicator is seen for certain.
            page.evaluate("""() => {
                window.releaseAnswer = null;
                const held = new Promise((resolve) => { window.releaseAnswer = resolve; });
                const fetch = window.fetch;
                window.fetch = async (...args) => { const answer = await fetch(...args); await held; return answer; };
            }""")
            page.click("#go")
            sync_api.expect(page.locator("#progress")).to_be_visible()
            assert page.locator("#go").is_disabled()
            page.evaluate("() => window.releaseAnswer()")
            sync_api.expect(page.locator("#result")).to_be_visible(timeout=30_000)
            sync_api.expect(page.locator("#progress")).to_be_hidden()
            assert page.locator("#seed-out").inner_text() == "7"
            assert re.fullmatch(r"\d+\.\d\d s", page.locator("#time-out").inner_text())
            loaded = page.evaluate("() => document.getElementById('image').naturalWidth")
            assert loaded == 64
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 0
    assert Image.open(shot).size[0] == 900
