"""`kasoku serve`: the OpenAI Images API on a compiled pipeline, with a queue, dynamic batching,
limits, OpenAI-shaped errors, Prometheus metrics and a web page; on uvicorn, or on Ray Serve.

The flow, each step one module:

    config.prepare_serving (every check; the engines' profile: exactly the served sizes)
      → server.run_server (bind, then load or compile the engines; ready)  or  ray_serve.run_ray_serve
      → app.create_app: a request → fields.parse_* (checked, one job per image)
      → service.ImageService.check (the pipeline's own checks) → batching.Batcher (the queue; calls
        grouped by `kasoku batch`'s plan_batches, one seed per image) → the engine thread
      → PNG, base64, OpenAI's response shape;  metrics.Metrics counts along the way

Needs `pip install 'kasoku[serve]'` (FastAPI, uvicorn, prometheus-client, python-multipart and
Ray Serve); the modules import them where used.

One of the apps (with cli and batch), the top layer. May import: every layer, and the other apps.
"""

from .config import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_TIMEOUT,
    DEFAULT_WINDOW_MS,
    SERVE_EXTRA,
    ServeConfig,
    ServeNotInstalled,
    Size,
    api_key_from_env,
    prepare_serving,
    require_serve,
    serving_profile,
)
from .errors import InvalidRequest, NotReady, QueueFull, ServeError, TimedOut, Unauthorized
from .fields import ImageRequest, ServeJob, parse_edit, parse_generation
from .service import ImageService

__all__ = [
    "DEFAULT_MAX_QUEUE", "DEFAULT_TIMEOUT", "DEFAULT_WINDOW_MS", "ImageRequest", "ImageService", "InvalidRequest",
    "NotReady", "QueueFull", "SERVE_EXTRA", "ServeConfig", "ServeError", "ServeJob", "ServeNotInstalled", "Size",
    "TimedOut", "Unauthorized", "api_key_from_env", "parse_edit", "parse_generation", "prepare_serving",
    "require_serve", "serving_profile",
]
