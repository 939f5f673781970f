"""`kasoku serve --ray`: the same app (:func:`kasoku.serve.app.create_app`) as a Ray Serve
deployment of N replicas, locally or on a cluster, like `kasoku batch --ray`.

The driver (this process) compiles first, once, so replicas only load engines from the shared
cache: a replica that finds one missing fails rather than builds it. The driver hands them the
backends `auto` resolved to, so every replica runs exactly the driver's engines. Each replica has
its own queue, dynamic batcher and metrics; Ray Serve's proxy spreads requests over them.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import Any

from ..batch.ray import LOCAL_RAY, import_ray, ray_session
from ..batch.worker import PipelineRecipe, StageHook
from ..core.options import FASTEST
from .config import ServeConfig, ServeNotInstalled
from .service import ImageService

APP_NAME = "kasoku"
RAY_SERVE_EXTRA = "pip install 'kasoku[serve]' (it brings ray[serve])"


def import_serve():
    import_ray()
    try:
        from ray import serve
    except ImportError:
        raise ServeNotInstalled(f"--ray needs Ray Serve, which is not installed here: {RAY_SERVE_EXTRA}") from None
    return serve


def pinned(config: ServeConfig, pipeline) -> ServeConfig:
    """`config` with what compiling resolved: the backend per component (and the precision per
    component, for `fastest`), so replicas load exactly these engines and measure nothing."""
    report = pipeline.compile_report
    options = config.options.replace(backend=dict(report.backends), components=tuple(report.backends))
    if config.options.precision == FASTEST:
        options = options.replace(precision=dict(report.precisions))
    return config.replace(options=options)


def replica_class():
    """The deployment's class: one ImageService over engines loaded from the cache, behind the app."""
    from ray import serve

    @serve.ingress()
    class KasokuReplica:
        def __init__(self, config: ServeConfig):
            from ..core.console import quiet_third_party_logs

            quiet_third_party_logs()
            if config.options.threads:  # the scheduler's torch ops share the replica's CPUs
                import torch

                torch.set_num_threads(config.options.threads)
            self.service = ImageService(config)
            self.service.load(build=False)

        def __serve_build_asgi_app__(self):
            from .app import create_app

            return create_app(self.service)

    return KasokuReplica


def deployment(config: ServeConfig, replicas: int, gpus_per_replica: float = 0.0):
    """The bound Ray Serve application: `replicas` copies, each taking as many requests at once as its
    queue and one call hold (beyond that, its own 429s)."""
    from ray import serve

    cpus = config.options.threads or 1
    return serve.deployment(
        replica_class(), name=APP_NAME, num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus_per_replica},
        max_ongoing_requests=config.max_queue + config.max_batch,
        graceful_shutdown_timeout_s=config.timeout + 5,
    ).bind(config)


def replica_states() -> dict[str, int]:
    """How many replicas are in each state ("RUNNING": 2, ...)."""
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return {}
    states: dict[str, int] = {}
    for status in app.deployments.values():
        for state, count in status.replica_states.items():
            states[str(getattr(state, "value", state))] = states.get(str(getattr(state, "value", state)), 0) + count
    return states


def run_ray_serve(config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = LOCAL_RAY,
                  replicas: int = 1, gpus_per_replica: float = 0.0, reference=None,
                  on_stage: StageHook | None = None,
                  on_ready: Callable[[str, dict[str, Any]], None] | None = None) -> int:
    """Compile here, deploy `replicas` replicas on Ray Serve at http://host:port, serve until SIGTERM or
    Ctrl-C, then shut the deployment down (Ray Serve lets each replica finish its requests)."""
    serve = import_serve()
    pipeline = PipelineRecipe(config.model, config.options).load(reference, on_stage)
    config = pinned(config, pipeline)
    startup = {"engines_built": pipeline.compile_report.built, "backends": dict(pipeline.compile_report.backends)}
    del pipeline  # the replicas hold their own

    cpus = config.options.threads or 1
    with ray_session(address, replicas * cpus), _stop_signals() as stop:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(deployment(config, replicas, gpus_per_replica), name=APP_NAME, route_prefix="/")
            if on_ready:
                on_ready(f"http://{host}:{port}", {**startup, "replicas": replica_states()})
            while not stop.wait(0.5):  # a timed wait: the signal handler runs between waits
                pass
        finally:
            serve.shutdown()
    return 0


@contextlib.contextmanager
def _stop_signals():
    """An Event set by SIGTERM or SIGINT. Entered after `ray.init`, whose own SIGTERM handler would
    abort the driver instead."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler installed outside Python (Ray's), which cannot be put back
                signal.signal(sig, handler)


__all__ = ["APP_NAME", "deployment", "import_serve", "pinned", "replica_class", "replica_states", "run_ray_serve"]
