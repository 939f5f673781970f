"""What a server serves, decided and checked once before anything is bound or built: the model, the
image sizes, the engines' profile, the batching and queue limits, and the API key."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.choices import (  # noqa: F401 - the serve defaults and Size, where callers of the config read them
    DEFAULT_BATCH_SIZE,
    DEFAULT_GUIDANCE,
    DEFAULT_MAX_QUEUE,
    DEFAULT_STEPS,
    DEFAULT_TIMEOUT,
    DEFAULT_WINDOW_MS,
    Size,
)
from ..core.components import ImageShape, ShapeProfile
from ..core.errors import KasokuError
from ..core.options import CompileOptions
from ..core.schedulers import most_steps

SERVE_EXTRA = "pip install 'kasoku[serve]'"
# what each is called on PyPI -> the names it may be imported by (python-multipart renamed its module)
SERVE_MODULES = {"FastAPI": ("fastapi",), "uvicorn": ("uvicorn",), "prometheus-client": ("prometheus_client",),
                 "python-multipart": ("python_multipart", "multipart")}



class ServeNotInstalled(KasokuError, ImportError):
    """kasoku serve without the serve extra."""


def require_serve(what: str = "kasoku serve") -> None:
    """The server's stack is importable, or an error naming the extra that installs it."""
    missing = [name for name, modules in SERVE_MODULES.items()
               if all(importlib.util.find_spec(module) is None for module in modules)]
    if missing:
        raise ServeNotInstalled(f"{what} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                                f"not installed here: {SERVE_EXTRA}")


@dataclass(frozen=True)
class ServeConfig:
    """Everything a server process (or each Ray Serve replica) needs; small and picklable."""

    model: str  # a folder as an absolute path (replicas do not share our working directory), or a hub id
    model_name: str  # what clients send as `model`
    options: CompileOptions  # with the profile, every component, and an absolute cache folder
    sizes: tuple[Size, ...]  # the sizes requests may ask for; the first is the default
    max_batch: int = DEFAULT_BATCH_SIZE
    batch_window_ms: float = DEFAULT_WINDOW_MS
    max_queue: int = DEFAULT_MAX_QUEUE
    timeout: float = DEFAULT_TIMEOUT
    api_key: str | None = field(default=None, repr=False)
    max_steps: int = 1000  # the scheduler's training steps
    default_steps: int = DEFAULT_STEPS  # a request without `steps` or `guidance` gets the model family's
    default_guidance: float = DEFAULT_GUIDANCE
    loras: tuple[tuple[str, str], ...] = ()  # (name, absolute path): the LoRA adapters requests may name
    ip_adapter: str | None = None  # an IP-Adapter weights file (absolute): requests may send `ip_image`
    cache_methods: tuple[str, ...] = ()  # the step-caching methods of the model's denoiser (kasoku.core.step_cache)

    @property
    def lora_names(self) -> tuple[str, ...]:
        return tuple(name for name, _path in self.loras)

    def replace(self, **changes) -> ServeConfig:
        return replace(self, **changes)

    @property
    def default_size(self) -> Size:
        return self.sizes[0]

    @property
    def sizes_text(self) -> str:
        return ", ".join(map(str, self.sizes))


def serving_profile(base: ShapeProfile, sizes: tuple[Size, ...], max_batch: int) -> ShapeProfile:
    """The engines a server needs: exactly its sizes (static height and width when it serves one size,
    the fastest engines on CPU backends), 1 to `max_batch` images per call (a call runs only the
    images it has), with and without classifier-free guidance (a request's `guidance` decides)."""
    heights = sorted({s.height for s in sizes})
    widths = sorted({s.width for s in sizes})
    first = sizes[0]
    return ShapeProfile.from_ranges((1, max_batch, max_batch), (heights[0], first.height, heights[-1]),
                                    (widths[0], first.width, widths[-1]), base.multiple, guidance=None)


def serves_every_request(profile: ShapeProfile, sizes: tuple[Size, ...], max_batch: int) -> bool:
    return all(profile.serves(ImageShape(batch, s.height, s.width), guided)
               for s in sizes for batch in (1, max_batch) for guided in (False, True))


def _portable_model(model) -> str:
    if isinstance(model, (str, Path)) and Path(model).expanduser().exists():
        return str(Path(model).expanduser().absolute())
    if not isinstance(model, (str, Path)):
        raise KasokuError(f"kasoku serve takes a model folder or hub id, not a {type(model).__name__}.")
    return str(model)


def api_key_from_env(variable: str | None) -> str | None:
    """The key of `--api-key-env VAR`: the variable must be set and not empty."""
    if variable is None:
        return None
    key = os.environ.get(variable, "")
    if not key.strip():
        raise KasokuError(f"--api-key-env {variable}: the environment variable {variable} is "
                          f"{'empty' if variable in os.environ else 'not set'}; set it to the key clients must send "
                          "(Authorization: Bearer KEY).")
    return key.strip()


def prepare_serving(model, options: CompileOptions | None = None, *, sizes: tuple[Size, ...] = (),
                    max_batch: int = DEFAULT_BATCH_SIZE, batch_window_ms: float = DEFAULT_WINDOW_MS,
                    max_queue: int = DEFAULT_MAX_QUEUE, timeout: float = DEFAULT_TIMEOUT,
                    api_key: str | None = None, model_name: str | None = None,
                    loras: tuple[tuple[str, str], ...] = (), ip_adapter: str | Path | None = None):
    """Every check before anything is bound or built; returns (ServeConfig, the lazily loaded model).

    Reads the model's configs, not its weights nor the engines. The profile is that of engines
    already in the cache that serve every size (built for this server, or for the model's default
    range), else the serving profile (built when the server starts). `loras`: (name, file) of the LoRA
    adapters requests may name; with them the attention projections are run-time weights (rebound per
    call, as for `kasoku batch`) unless the options name other targets. `ip_adapter`: an IP-Adapter weights file
    (its image encoder beside it) requests may send image prompts for (`ip_image`)."""
    from ..build.compiler import cached_profile
    from ..core.cache import default_cache_dir
    from ..model.pipeline_model import Model

    for name, value, least in (("--max-batch", max_batch, 1), ("--max-queue", max_queue, 1)):
        if value < least:
            raise KasokuError(f"{name} must be at least {least} but is {value}.")
    if not timeout > 0:
        raise KasokuError(f"--timeout must be more than 0 seconds but is {timeout}.")
    if not batch_window_ms >= 0:
        raise KasokuError(f"--batch-window-ms must be 0 or more but is {batch_window_ms}.")
    options = options or CompileOptions()
    model = _portable_model(model)
    reference = Model.load(model, lazy=True)
    base = reference.default_profile()
    native = reference.native_size
    sizes = tuple(dict.fromkeys(sizes)) or (Size(native, native),)
    bad = [str(s) for s in sizes if s.width % base.multiple or s.height % base.multiple]
    if bad:
        raise KasokuError(f"--size: width and height must be multiples of {base.multiple} for this model (the VAE's "
                          f"8x times the U-Net's downsampling) but {', '.join(bad)} "
                          f"{'is' if len(bad) == 1 else 'are'} not.")
    loras = _checked_loras(loras, reference)
    if ip_adapter is not None:
        from ..runtime.image_prompts import check_adapter_files

        check_adapter_files([ip_adapter], flag="--ip-adapter")
        if not reference.family.runs_ip_adapters:
            raise KasokuError(f"--ip-adapter: IP-Adapters on {reference.family.title} engines are not supported.")
        ip_adapter = str(Path(ip_adapter).absolute())
    cache = (options.cache_dir or default_cache_dir()).absolute()
    options = options.replace(cache_dir=cache, components=options.components or reference.components,
                              lora_targets=options.lora_targets or (("attention",) if loras else ()))
    wanted = serving_profile(base, sizes, max_batch)
    candidates = [p for p in (wanted, base) if serves_every_request(p, sizes, max_batch)]
    profile = cached_profile(model, options, candidates) or wanted
    config = ServeConfig(model=model, model_name=model_name or Path(model).name,
                         options=options.replace(profile=profile), sizes=sizes, max_batch=max_batch,
                         batch_window_ms=batch_window_ms, max_queue=max_queue, timeout=timeout, api_key=api_key,
                         max_steps=most_steps(reference.scheduler), loras=loras, ip_adapter=ip_adapter,
                         cache_methods=reference.family.cache_methods,
                         **dict(zip(("default_steps", "default_guidance"), reference.command_defaults())))
    return config, reference


# what a request may call an adapter: it travels in JSON and in a form field's comma-separated list
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _checked_loras(loras, reference) -> tuple[tuple[str, str], ...]:
    """Each adapter's name (unique, of LORA_NAME's letters) and file (a LoRA of this model, as an absolute
    path: Ray Serve replicas do not share our working directory)."""
    from ..runtime.lora import check_adapter_file

    checked: dict[str, str] = {}
    for name, path in loras:
        if not LORA_NAME.fullmatch(name):
            raise KasokuError(f"--lora {name}=...: an adapter's name is letters, digits, '.', '_' and '-' (starting "
                              "with a letter or digit), what requests send in `loras`.")
        if name in checked:
            raise KasokuError(f"--lora {name}=... is given twice; give each adapter its own name.")
        check_adapter_file(Path(path), reference, "--lora")
        checked[name] = str(Path(path).expanduser().absolute())
    return tuple(checked.items())


__all__ = ["DEFAULT_MAX_QUEUE", "DEFAULT_TIMEOUT", "DEFAULT_WINDOW_MS", "SERVE_EXTRA", "ServeConfig",
           "ServeNotInstalled", "Size", "api_key_from_env", "prepare_serving", "require_serve", "serving_profile"]
