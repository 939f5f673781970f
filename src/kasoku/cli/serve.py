"""`kasoku serve`: an image-generation server that speaks the OpenAI Images API."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..core.errors import KasokuError
from .base import (
    Command,
    add_engine_arguments,
    add_model,
    add_recipe,
    add_step_cache_arguments,
    image_size,
    options_from_args,
    positive_int,
    show_stage,
)


class Serve(Command):
    """Serve the compiled pipeline over HTTP with the OpenAI Images API (needs kasoku[serve]).

    POST /v1/images/generations (JSON: prompt, n, size "WxH", response_format b64_json, model, quality
    (low 0.5x, medium/standard/auto 1x, high/hd 1.5x the model's steps), style (taken and ignored); and
    kasoku's negative_prompt, steps, guidance, seed, cache_interval and cache_schedule (with
    --step-cache), loras (adapters given with --lora NAME=PATH), ip_image (base64) and ip_scale (with
    --ip-adapter FILE)) and POST /v1/images/edits (multipart: image, and mask for inpainting, else img2img;
    strength; an ip_image file). Requests with the same size,
    steps, guidance, step caching, adapters and presence of a negative prompt that arrive within the
    batch window share engine calls, each image with its own seed (image i of a request gets seed + i).
    GET /healthz, /readyz (200 once the engines are loaded), /metrics (Prometheus) and / (a web page to
    try it). The engines are compiled or loaded before the server
    reports ready; SIGTERM or Ctrl-C stops taking requests, answers those in flight, then exits.
    """

    name = "serve"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ..core.choices import DEFAULT_BATCH_SIZE, DEFAULT_MAX_QUEUE, DEFAULT_TIMEOUT, DEFAULT_WINDOW_MS, LOG_LEVELS

        add_model(p)
        p.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
        p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free port, printed)")
        p.add_argument("--size", type=image_size, action="append", metavar="WxH",
                       help="an image size requests may ask for, WIDTHxHEIGHT; repeat for several (default: the "
                            "model's native size, e.g. 512x512). The engines are built for exactly these sizes (one "
                            "size: static height and width, the fastest engines on CPU backends), for 1 to "
                            "--max-batch images per call, with and without guidance; engines already in the cache "
                            "for the model's default range that serve them are used instead of building new ones")
        p.add_argument("--max-batch", type=positive_int, default=DEFAULT_BATCH_SIZE,
                       help=f"most images per engine call (default {DEFAULT_BATCH_SIZE}; 1 turns batching off)")
        p.add_argument("--batch-window-ms", type=_non_negative, default=DEFAULT_WINDOW_MS, metavar="MS",
                       help=f"how long the oldest waiting image waits for others to share its call (default "
                            f"{DEFAULT_WINDOW_MS:g}); under load calls run back to back, each taking what arrived "
                            "during the last")
        p.add_argument("--max-queue", type=positive_int, default=DEFAULT_MAX_QUEUE,
                       help=f"most images waiting for an engine call (default {DEFAULT_MAX_QUEUE}); a request that "
                            "does not fit is answered 429 with Retry-After")
        p.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                       help=f"seconds from a request's arrival to its answer (default {DEFAULT_TIMEOUT:g}); later: "
                            "504, and its images leave the queue or stop between denoising steps")
        p.add_argument("--api-key-env", metavar="VAR",
                       help="require `Authorization: Bearer KEY` on /v1/ routes, KEY being the value of the "
                            "environment variable VAR (default: no key)")
        p.add_argument("--model-name", metavar="NAME",
                       help="the `model` id clients may send (default: the model folder's name)")
        p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                       help="uvicorn's log level (default info: one line per request)")
        p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       help="run on Ray Serve (in kasoku[serve]): alone, a Ray instance started on this machine; "
                            "with ADDRESS (auto, HEAD:6379, ray://HEAD:10001) that cluster, whose nodes must have "
                            "kasoku and see the model and --cache-dir at the same paths. This process compiles "
                            "first; replicas only load engines from the cache")
        p.add_argument("--replicas", type=positive_int, default=None,
                       help="with --ray: replicas, each holding one pipeline, its own queue and batcher (default 1)")
        p.add_argument("--gpus-per-replica", type=_non_negative, default=0.0,
                       help="with --ray: GPUs Ray gives each replica, e.g. 1 for GPU backends (default 0)")
        p.add_argument("--lora", type=_named_lora, action="append", default=[], metavar="NAME=PATH",
                       help="a LoRA adapter requests may ask for by NAME in `loras` (\"NAME[:SCALE]\"); repeat for "
                            "several. With adapters the attention projections are run-time weights (see "
                            "--lora-targets), rebound per call: requests with other adapter sets use other calls")
        p.add_argument("--ip-adapter", type=Path, default=None, metavar="FILE",
                       help="an IP-Adapter weights file (plain or Plus; its image encoder in image_encoder/ beside "
                            "it): requests may send an image prompt, `ip_image` (base64 in generations, an uploaded "
                            "file in edits) and `ip_scale`; requests without one run at scale 0")
        add_engine_arguments(p, profile_flags=False)
        add_recipe(p)
        add_step_cache_arguments(p, per_call=False)

    def run(self, args: argparse.Namespace) -> int:
        from ..serve.config import api_key_from_env, prepare_serving, require_serve

        if args.ray is None and (args.replicas is not None or args.gpus_per_replica):
            raise KasokuError("--replicas and --gpus-per-replica need --ray (without it, one process serves).")
        if args.ray is not None and args.port == 0:
            raise KasokuError("--port 0 cannot be used with --ray: Ray Serve's proxy needs a fixed port; give one.")
        require_serve()
        if args.ray is not None:
            from ..serve.ray_serve import import_serve

            import_serve()
            args.threads = args.threads or 1  # Ray: one CPU per replica unless asked, as for kasoku batch --ray
        api_key = api_key_from_env(args.api_key_env)
        options = options_from_args(args)
        config, reference = prepare_serving(
            args.model, options, sizes=tuple(args.size or ()), max_batch=args.max_batch,
            batch_window_ms=args.batch_window_ms, max_queue=args.max_queue, timeout=args.timeout, api_key=api_key,
            model_name=args.model_name, loras=tuple(args.lora), ip_adapter=args.ip_adapter)
        if args.ray is None:
            from ..serve.server import run_server

            def on_listening(url: str) -> None:  # bound: a port in use was said before, as one line
                _say_plan(config)
                _say_listening(url)

            return run_server(config, host=args.host, port=args.port, reference=reference,
                              on_listening=on_listening, on_ready=_say_ready, on_failure=_say_failure,
                              on_stage=show_stage, log_level=args.log_level)
        from ..serve.ray_serve import run_ray_serve

        _say_plan(config)
        return run_ray_serve(config, host=args.host, port=args.port, address=args.ray, replicas=args.replicas or 1,
                             gpus_per_replica=args.gpus_per_replica, reference=reference, on_stage=show_stage,
                             on_ready=_say_ray_ready)


def _say(text: str) -> None:
    from ..core.console import console

    console.print(text, markup=False, highlight=False, soft_wrap=True)
    console.file.flush()


def _say_plan(config) -> None:
    profile = config.options.profile
    shape = "static" if profile.min.height == profile.max.height and profile.min.width == profile.max.width \
        else "ranged"
    _say(f"kasoku serve: {config.model_name} at {config.sizes_text}; engines for 1..{profile.max.batch} images per "
         f"call, {shape} height {profile.range_text('height')} and width {profile.range_text('width')}; max batch "
         f"{config.max_batch}, window {config.batch_window_ms:g} ms, queue {config.max_queue}, timeout "
         f"{config.timeout:g} s{', API key required' if config.api_key else ''}"
         f"{'; LoRA adapters ' + ', '.join(config.lora_names) if config.loras else ''}")


def _say_listening(url: str) -> None:
    _say(f"listening on {url} (GET /readyz answers 200 once the engines are loaded)")


def _say_ready(service) -> None:
    startup = service.startup
    built = f", {startup['engines_built']} stages built" if startup.get("engines_built") else ", from the cache"
    _say(f"ready: engines loaded in {startup['seconds']:.1f} s{built}; backends: {startup['backends']}")


def _say_failure(reason: str) -> None:
    _say(f"error: the engines could not be loaded: {reason}")


def _say_ray_ready(url: str, startup: dict) -> None:
    replicas = ", ".join(f"{count} {state.lower()}" for state, count in startup["replicas"].items()) or "none"
    backends = ", ".join(f"{name}={backend}" for name, backend in startup["backends"].items())
    _say(f"ready on Ray Serve at {url}: replicas {replicas}; backends: {backends}")


def _port(text: str) -> int:
    from .base import _number

    return _number(int, text, "a port in 0..65535", lambda v: 0 <= v <= 65535)


def _non_negative(text: str) -> float:
    from .base import _number

    return _number(float, text, "a number >= 0", lambda v: v >= 0 and v != float("inf"))


def _positive_seconds(text: str) -> float:
    from .base import _number

    return _number(float, text, "a number of seconds > 0", lambda v: 0 < v < float("inf"))


def _named_lora(text: str) -> tuple[str, str]:
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise argparse.ArgumentTypeError(f"give NAME=PATH (the name requests use, then the adapter's file), not "
                                         f"{text!r}")
    return name, path


__all__ = ["Serve"]
