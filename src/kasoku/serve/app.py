"""The HTTP surface: the OpenAI Images API on the compiled pipeline, health, readiness, metrics and
the web page, with every error in OpenAI's shape and the right status. The same app runs under
uvicorn (:mod:`kasoku.serve.server`) and in each Ray Serve replica (:mod:`kasoku.serve.ray_serve`).

    POST /v1/images/generations   JSON: prompt, n, size "WxH", response_format b64_json, model, user,
                                  and kasoku's negative_prompt, steps, guidance, seed
    POST /v1/images/edits         multipart: image (and mask: inpaint; without: img2img), strength,
                                  and the fields above
    GET  /v1/models               the one model served
    GET  /healthz                 the process answers
    GET  /readyz                  200 once the engines are loaded, 503 before
    GET  /metrics                 Prometheus text format
    GET  /                        the web page

FastAPI is imported at the top: this module is imported only to serve (after `require_serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from .errors import InvalidRequest, ServeError, Unauthorized, error_body
from .fields import ImageRequest, parse_edit, parse_generation
from .page import render_page
from .service import ImageService, encode

log = logging.getLogger("kasoku.serve")

ROUTES = ("/", "/healthz", "/readyz", "/metrics", "/v1/models", "/v1/images/generations", "/v1/images/edits")
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error"}
UPLOADS = ("image", "mask", "ip_image")  # the files an edit takes: the picture, its mask, an image prompt
MAX_UPLOAD_FILES = len(UPLOADS)


def create_app(service: ImageService, *, load: Callable[[], None] | None = None):
    """The FastAPI app over `service`. `load`, when given, runs on a thread of its own once the app has
    started (the engines compile or load while /healthz already answers and /readyz says 503)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await service.start()
        if load is not None:
            import threading

            threading.Thread(target=load, name="kasoku-load-engines", daemon=True).start()
        yield
        await service.stop()

    app = FastAPI(title="kasoku serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    # ---- errors: OpenAI's shape, counted by status ----------------------------------------------

    @app.exception_handler(ServeError)
    async def serve_error(_request: Request, error: ServeError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = f"{request.method} {request.url.path}: {error.detail}"
        if error.status_code == 404:
            message = f"there is no {request.url.path} here; the routes are {', '.join(ROUTES)}."
        return JSONResponse(error_body(message, ERROR_TYPES.get(error.status_code, "server_error")),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.middleware("http")
    async def count(request: Request, call_next):
        endpoint = request.url.path if request.url.path in ROUTES else "other"
        try:
            response = await call_next(request)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            service.metrics.answered(endpoint, 500)
            return JSONResponse(error_body("the server failed on this request; its log says why.", "server_error"),
                                status_code=500)
        service.metrics.answered(endpoint, response.status_code)
        return response

    def authorize(request: Request) -> None:
        key = service.config.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Unauthorized("this server needs an API key: send the header `Authorization: Bearer KEY` (the key "
                               "is in the environment variable the server was started with, --api-key-env).")
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise Unauthorized("the API key is not this server's; check the `Authorization: Bearer KEY` header.")

    keyed = [Depends(authorize)]

    # ---- the OpenAI Images API -----------------------------------------------------------------

    @app.post("/v1/images/generations", dependencies=keyed)
    async def generations(request: Request):
        arrived = time.monotonic()
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise InvalidRequest(f"the body must be JSON, sent with `Content-Type: application/json` (this request's "
                                 f"is {kind or 'missing'}).")
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequest("the body must be a JSON object, e.g. {\"prompt\": \"a cat\", \"size\": "
                                 f"\"{service.config.default_size}\"}}.") from None
        return await _answer(parse_generation(body, service.config), arrived, "/v1/images/generations")

    @app.post("/v1/images/edits", dependencies=keyed)
    async def edits(request: Request):
        arrived = time.monotonic()
        text, files = await _read_form(request)
        image, mask = files.get("image"), files.get("mask")
        parsed = await asyncio.to_thread(parse_edit, text, image, mask, service.config, files.get("ip_image"))
        return await _answer(parsed, arrived, "/v1/images/edits")

    async def _read_form(request: Request) -> tuple[dict[str, str], dict[str, bytes]]:
        """Text fields and files of a multipart body; each field at most once."""
        try:
            form = await request.form(max_files=MAX_UPLOAD_FILES + 1)
        except Exception as error:  # noqa: BLE001 - python-multipart's errors vary by version
            raise InvalidRequest(f"the body must be multipart/form-data with an `image` file: {error}") from None
        text: dict[str, str] = {}
        files: dict[str, bytes] = {}
        for name, value in form.multi_items():
            if name in text or name in files:
                raise InvalidRequest(f"`{name}` is given more than once; one image (and one mask) per request.",
                                     param=name)
            if isinstance(value, str):
                if name in UPLOADS:
                    raise InvalidRequest(f"`{name}` must be an uploaded file, not a text field.", param=name)
                text[name] = value
            else:
                if name not in UPLOADS:
                    raise InvalidRequest(f"`{name}` is a file, but only {', '.join(f'`{u}`' for u in UPLOADS)} are "
                                         "files; one each per request.", param=name)
                files[name] = await value.read()
        await form.close()
        return text, files

    async def _answer(request: ImageRequest, arrived: float, endpoint: str) -> dict[str, Any]:
        images = await service.generate(request, arrived)
        encoded = await encode(images)
        seconds = time.monotonic() - arrived
        service.metrics.latency.labels(endpoint=endpoint).observe(seconds)
        return {
            "created": int(time.time()),
            "data": [{"b64_json": b64, "seed": seed, "revised_prompt": None}
                     for b64, seed in zip(encoded, request.seeds)],
            "output_format": "png",
            "kasoku": {"seconds": round(seconds, 4), "size": str(request.size), "task": request.task,
                       "steps": request.steps, "replica": service.replica},
        }

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return {"object": "list",
                "data": [{"id": service.config.model_name, "object": "model", "created": 0, "owned_by": "kasoku"}]}

    # ---- operations -----------------------------------------------------------------------------

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get("/readyz")
    async def readyz():
        return JSONResponse(service.describe(), status_code=200 if service.ready else 503,
                            headers={} if service.ready else {"Retry-After": "5"})

    @app.get("/metrics")
    async def metrics():
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return render_page(service.config, service.startup.get("backends", ""))

    return app


__all__ = ["ROUTES", "create_app"]
