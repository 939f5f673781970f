"""IP-Adapters on a compiled pipeline: diffusers' own loader on the torch pipeline, checked first.

`KasokuPipeline.load_ip_adapter` takes diffusers' arguments and lets diffusers' `load_ip_adapter` read the
files and load the adapters into the torch U-Net (its converters of the published layouts, its image
encoder and image processor); kasoku then builds the engines that run them (the image encoder and the U-Net
with image-prompt inputs, see :mod:`kasoku.architectures.ip_adapter`). The scale is an engine input:
`set_ip_adapter_scale` is diffusers' own on the torch U-Net, which the engines read on every call.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..architectures import ip_adapter
from ..core.errors import KasokuError
from ..model.pipeline_model import Model

ADAPTER_FILE_KINDS = (".safetensors", ".bin")


class IPAdapterError(KasokuError, ValueError):
    """An IP-Adapter kasoku cannot load or run."""


def check_source(source: Any, subfolder: Any, weight_name: Any) -> None:
    """Local files that are missing are named before anything is read (a hub id is left to diffusers)."""
    sources = source if isinstance(source, list) else [source]
    names = weight_name if isinstance(weight_name, list) else [weight_name]
    folders = subfolder if isinstance(subfolder, list) else [subfolder]
    for one in sources:
        if isinstance(one, dict):
            continue
        if not isinstance(one, (str, Path)):
            raise IPAdapterError(f"an IP-Adapter is a folder, a hub id or a state dict, not a {type(one).__name__}.")
        root = Path(one)
        if not root.exists():
            if str(one).startswith((".", "/", "~")) or root.suffix in ADAPTER_FILE_KINDS:
                raise IPAdapterError(f"the IP-Adapter folder {one} does not exist.")
            continue  # a hub id: diffusers says whether it can be had (HF_HUB_OFFLINE is respected there)
        for name, folder in zip(names if len(names) > 1 or len(sources) == 1 else names * len(sources),
                                folders * len(names) if len(folders) == 1 else folders):
            file = root / (folder or "") / str(name)
            if not file.is_file():
                raise IPAdapterError(f"the IP-Adapter weights {file} do not exist; give weight_name= the file's name "
                                     f"in {root / (folder or '')} (e.g. ip-adapter_sd15.safetensors).")


def check_adapter_file(path: str | Path, flag: str = "IP-Adapter") -> None:
    """Before anything heavy: `path` is a weights file that holds an IP-Adapter (image_proj and ip_adapter
    tensors); its header is read, not its weights."""
    path = Path(path)
    if not path.is_file():
        raise IPAdapterError(f"{flag} {path} {'is a folder' if path.is_dir() else 'does not exist'}; give the "
                             "adapter's weights file (e.g. ip-adapter_sd15.safetensors).")
    if path.suffix not in ADAPTER_FILE_KINDS:
        raise IPAdapterError(f"{flag} {path} is not a .safetensors or .bin file.")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as file:
                keys = list(file.keys())
        except Exception as error:  # safetensors raises its own kinds on a damaged header
            raise IPAdapterError(f"{flag} {path} is not a readable safetensors file: {error}") from None
        if not any(k.startswith("image_proj.") for k in keys) or not any(k.startswith("ip_adapter.") for k in keys):
            raise IPAdapterError(f"{flag} {path} holds no IP-Adapter (no image_proj.* and ip_adapter.* tensors).")


def image_encoder_for(adapter: str | Path, given: str | Path | None = None) -> Path:
    """The image encoder folder of an adapter file: `given`, else image_encoder/ beside the file or beside its
    folder (the published layouts: models/image_encoder next to models/ip-adapter_sd15.safetensors)."""
    adapter = Path(adapter)
    candidates = [Path(given)] if given is not None else [adapter.parent / "image_encoder",
                                                          adapter.parent.parent / "image_encoder"]
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder.resolve()
    where = " or ".join(str(c) for c in candidates)
    raise IPAdapterError(f"no image encoder (a CLIPVisionModelWithProjection folder with config.json) at {where}; "
                         "give --ip-image-encoder DIR.")


def check_adapter_files(files, image_encoder: str | Path | None = None, flag: str = "IP-Adapter") -> Path:
    """Before anything heavy: each file is an IP-Adapter (see :func:`check_adapter_file`); the image encoder folder
    they load with (see :func:`image_encoder_for`)."""
    for file in files:
        check_adapter_file(file, flag)
    return image_encoder_for(files[0], image_encoder)


def file_arguments(files, image_encoder: str | Path | None = None, family=None) -> dict[str, Any]:
    """diffusers' `load_ip_adapter` arguments (by name) for adapter weights files: their folders, no subfolder,
    their names, and the image encoder folder (beside the first file, or `image_encoder`) under the name the
    family's loader reads it by (see Family.ip_encoder_argument)."""
    files = [Path(f) for f in files]
    encoder_argument = family.ip_encoder_argument if family is not None else "image_encoder_folder"
    arguments = {"pretrained_model_name_or_path_or_dict": [str(f.parent) for f in files], "subfolder": "",
                 "weight_name": [f.name for f in files],
                 encoder_argument: str(image_encoder_for(files[0], image_encoder))}
    if family is not None and family.ip_max_adapters == 1:  # its loader takes one adapter, not lists
        if len(files) > 1:
            raise IPAdapterError(f"{family.title} pipelines load one IP-Adapter at a time; {len(files)} given.")
        arguments.update(pretrained_model_name_or_path_or_dict=str(files[0].parent), weight_name=files[0].name)
    return arguments


def bind_load_arguments(model: Model, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A `load_ip_adapter` call's arguments by name, bound as the model's diffusers pipeline binds them (the U-Net
    pipelines take (source, subfolder, weight_name, ...), SD3's and Flux's (source, weight_name, subfolder, ...)),
    with its defaults."""
    import inspect

    method = getattr(type(model.pipe), "load_ip_adapter", None)
    if method is None or not model.family.runs_ip_adapters:
        raise IPAdapterError(f"IP-Adapters on {model.family.title} engines are not supported; kasoku runs them "
                             "on SD 1.x, 2.x, XL, SD3 and Flux.1.")
    try:
        bound = inspect.signature(method).bind(model.pipe, *args, **kwargs)
    except TypeError as error:
        raise IPAdapterError(f"load_ip_adapter: {error}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    arguments.update(arguments.pop("kwargs", {}))
    return arguments


def load_into(model: Model, *args: Any, **kwargs: Any) -> tuple[str, ...]:
    """diffusers' `load_ip_adapter` (its arguments as the model's pipeline takes them) on the model's torch
    pipeline; the adapters' kinds, checked to run on engines (anything else is unloaded again and refused)."""
    family = model.family
    arguments = bind_load_arguments(model, args, kwargs)
    source = arguments["pretrained_model_name_or_path_or_dict"]
    check_source(source, arguments.get("subfolder"), arguments.get("weight_name"))
    model.changing(family.denoiser)
    try:
        _load_image_encoder(model, arguments)
        model.pipe.load_ip_adapter(**arguments)
    except (OSError, ValueError, KeyError, RuntimeError) as error:  # diffusers' loaders raise these on bad files
        unload_from(model)
        raise IPAdapterError(f"cannot load the IP-Adapter {source if not isinstance(source, dict) else '(dict)'}: "
                             f"{str(error).splitlines()[0]}") from None
    try:
        kinds = family.ip_adapters(model)
        encoder = getattr(model.pipe, ip_adapter.IMAGE_ENCODER, None)
        if encoder is not None:
            if encoder.device.type == "meta":
                raise IPAdapterError("the image encoder was loaded without its weights; load the pipeline's "
                                     "modules first (kasoku.compile on a loaded pipeline).")
            ip_adapter.check_fits(getattr(model.pipe, family.denoiser), encoder.config)
    except KasokuError:
        unload_from(model)
        raise
    return kinds


def _image_encoder_location(model: Model, arguments: dict[str, Any]) -> tuple[Any, str] | None:
    """Where diffusers' loader reads the image encoder from: (folder or hub id, subfolder); None where it reads
    none (no folder given, a state dict)."""
    if model.family.ip_encoder_argument != "image_encoder_folder":  # Flux: its own path and subfolder
        where = arguments.get(model.family.ip_encoder_argument)
        return None if where is None else (where, arguments.get("image_encoder_subfolder") or "")
    source, folder = arguments["pretrained_model_name_or_path_or_dict"], arguments.get("image_encoder_folder")
    first = source[0] if isinstance(source, list) else source
    if folder is None or isinstance(first, dict):
        return None
    subfolder = arguments.get("subfolder")
    sub = subfolder[0] if isinstance(subfolder, list) else subfolder
    return first, Path(sub or "", folder).as_posix() if folder.count("/") == 0 else Path(folder).as_posix()


def _load_image_encoder(model: Model, arguments: dict[str, Any]) -> None:
    """The image encoder where diffusers' loader would read it, on the CPU in fp32: diffusers puts it on the
    pipeline's device, which a lazily loaded pipeline (modules on the meta device until needed) reports as meta,
    and Flux's loader in fp16 by default."""
    import transformers

    location = _image_encoder_location(model, arguments)
    if getattr(model.pipe, ip_adapter.IMAGE_ENCODER, None) is not None or location is None:
        return
    options = {k: arguments[k] for k in ("cache_dir", "local_files_only", "revision", "token") if k in arguments}
    encoder_class = getattr(transformers, model.family.ip_image_encoder)
    encoder = encoder_class.from_pretrained(location[0], subfolder=location[1], dtype=torch.float32, **options)
    model.pipe.register_modules(image_encoder=encoder.eval())
    if ip_adapter.is_siglip(encoder.config) and getattr(model.pipe, "feature_extractor", None) is None:
        # diffusers' SD3 loader reads the image processor beside the encoder only when it loads the encoder itself
        processor = transformers.SiglipImageProcessor.from_pretrained(location[0], subfolder=location[1], **options)
        model.pipe.register_modules(feature_extractor=processor)


def load_files(model: Model, files, image_encoder: str | Path | None = None) -> tuple[str, ...]:
    """IP-Adapter weights files (each checked first) into the model, with the image encoder beside the first (or
    `image_encoder`): what `--ip-adapter PATH` means to verify and bench."""
    files = [files] if isinstance(files, (str, Path)) else list(files)
    check_adapter_files(files, image_encoder)
    return load_into(model, **file_arguments(files, image_encoder, model.family))


def unload_from(model: Model) -> None:
    """diffusers' `unload_ip_adapter`: the U-Net's own attention and no image encoder again."""
    if ip_adapter.projection_layers(getattr(model.pipe, model.family.denoiser)) or \
            getattr(model.pipe, ip_adapter.IMAGE_ENCODER, None) is not None:
        model.pipe.unload_ip_adapter()
    model.changing(model.family.denoiser)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def set_scale(model: Model, scale: Any) -> None:
    """diffusers' `set_ip_adapter_scale` on the torch U-Net (a number, one per adapter, or per block as diffusers
    takes it), checked to be one the engines take (one value per adapter and layer)."""
    unet = getattr(model.pipe, model.family.denoiser)
    adapters = len(ip_adapter.projection_layers(unet))
    if not adapters:
        raise IPAdapterError("no IP-Adapter is loaded; call load_ip_adapter(...) first.")
    scales = scale if isinstance(scale, list) else [scale]
    if adapters == 1 and len(scales) > 1 and all(_is_number(s) for s in scales) and \
            model.family.ip_scale_per_block_list:
        scales = [scales]  # diffusers' Flux: one adapter's list of per-block numbers
    if len(scales) != adapters:
        raise IPAdapterError(f"`scale` must give one value (or per-block mapping) per IP-Adapter: {adapters} "
                             f"adapter(s) loaded but {len(scales)} given.")
    if any(isinstance(s, (int, float)) and not _is_number(s) for s in scales):
        raise IPAdapterError(f"an IP-Adapter scale is a finite number but {scale!r} is given.")
    processors = [proc for _, proc in ip_adapter.ip_processors(unet)]
    if all(_is_number(s) for s in scales):  # every layer gets its adapter's number: what diffusers sets, at once
        for proc in processors:  # (SD3's processors hold one number)
            proc.scale = [float(s) for s in scales] if isinstance(proc.scale, list) else float(scales[0])
        return
    kept = [list(proc.scale) if isinstance(proc.scale, list) else proc.scale for proc in processors]
    try:
        model.pipe.set_ip_adapter_scale(scale)
        ip_adapter.scales_of(unet)
    except (ValueError, TypeError, KeyError, KasokuError) as error:
        for proc, value in zip(processors, kept):
            proc.scale = value
        raise IPAdapterError(f"cannot set the IP-Adapter scale {scale!r}: {str(error).splitlines()[0]}") from None
