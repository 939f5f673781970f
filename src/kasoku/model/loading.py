"""Load a diffusers pipeline from a folder, a hub id or a live object (safetensors only).

``load_pipeline(folder, lazy=True)`` builds the torch models on the meta device from their configs
(no weights read) and loads each one for real only when something needs its weights: an export,
a parity check, a weight digest that is not remembered yet (:func:`real_module`). A warm start
that finds every engine in the cache therefore reads configs, tokenizers and the scheduler only.
"""

from __future__ import annotations

import copy
import importlib
import os
from pathlib import Path
from typing import Any

import torch

from ..architectures.base import module_at
from ..core.cache import unreadable_files
from ..core.console import hush_loaded_libraries
from ..core.errors import KasokuError, NotADiffusersPipeline
from ..core.weights import floating_dtype
from ..families import FAMILIES, SUPPORTED_PIPELINES, detect_family, family_of, read_model_index
from ..families.base import from_pipe

__all__ = ["ModelNotFound", "NotADiffusersPipeline", "SUPPORTED_PIPELINES", "load_pipeline", "load_controlnets",
           "read_model_index", "real_module", "own_module", "lazy_source", "release_module", "model_label", "module_at"]

_LAZY_SOURCE = "_kasoku_lazy_source"  # on a meta-device module: the folder its weights are in
_LOADED_LAZILY = "_kasoku_loaded_lazily"  # on a real module kasoku loaded in place of a meta one


class ModelNotFound(KasokuError, FileNotFoundError):
    """The model folder or hub id cannot be found."""


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def model_label(model: Any) -> str:
    """How a model is named in reports and the cache listing: a local folder by its absolute path (its identity,
    whatever folder a command runs in), a hub id as given, a live pipeline by its class."""
    if isinstance(model, (str, Path)):
        path = Path(model).expanduser()
        return str(path.resolve()) if path.exists() else str(model)
    return type(model).__name__


def _source(model: Any) -> str:
    path = Path(str(model)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotADiffusersPipeline(f"{path} is a file; give the folder of a diffusers pipeline.")
        detect_family(path)  # fails fast, before any weight is read, on an unsupported model
        check_component_folders(path)
        return str(path)
    if _looks_like_hub_id(str(model)):
        if _hub_offline():
            raise ModelNotFound(
                f"{model!r} is not a local folder and HF_HUB_OFFLINE is set, so it cannot be "
                "downloaded. Give a local diffusers folder, or unset HF_HUB_OFFLINE."
            )
        return str(model)
    raise ModelNotFound(
        f"model {str(model)!r} does not exist: give a diffusers pipeline folder or a hub id "
        "such as 'stable-diffusion-v1-5/stable-diffusion-v1-5'."
    )


def check_component_folders(folder: Path) -> None:
    """Every component model_index.json lists has its folder (diffusers would otherwise look for it on the hub and
    report a connection error)."""
    for name, value in read_model_index(folder).items():
        listed = isinstance(value, list) and len(value) == 2 and value[0] in ("diffusers", "transformers")
        if listed and not (folder / name).is_dir():
            raise ModelNotFound(f"{folder} is incomplete: model_index.json lists {name} ({value[1]}) but there is no "
                                f"{folder / name} folder. This is not a network problem: copy the whole pipeline "
                                "folder again, or save it with `pipe.save_pretrained(DIR)`.")
        component = folder / name
        if listed and (component / "config.json").is_file() and not _has_weights(component):
            raise ModelNotFound(f"{folder} is incomplete: {component} has a config.json but no weights file "
                                "(*.safetensors, *.bin, or a sharded index). This is not a network problem: copy the "
                                "whole pipeline folder again, or save it with `pipe.save_pretrained(DIR)`.")


def _has_weights(component: Path) -> bool:
    """Whether a model's folder holds its weights (a model's config.json beside them; tokenizers, schedulers and
    image processors have none)."""
    return any(component.glob("*.safetensors")) or any(component.glob("*.bin")) or \
        any(component.glob("*.index.json")) or any(component.glob("*.gguf"))


class DamagedModel(KasokuError, OSError):
    """A model folder whose files cannot be read (a truncated or corrupt weights file, a broken config)."""


def damaged_component(folder: Path, error: Exception) -> DamagedModel:
    """What is wrong with a folder that diffusers or transformers could not load, naming its files: unreadable ones
    (another user's, mode 0600 or 0640) as such, else damaged, truncated or missing ones."""
    unreadable = unreadable_files(folder)
    if unreadable:
        return DamagedModel(f"{folder} cannot be loaded: this user ({os.getuid()}) may not read "
                            f"{', '.join(unreadable)}. Make them readable (`chmod a+r FILE`) or run as their owner.")
    files = sorted(p.name for p in Path(folder).glob("*") if p.is_file())
    reason = str(error).splitlines()[0] if str(error) else ""
    return DamagedModel(f"{folder} cannot be loaded ({type(error).__name__}: {reason}); its files "
                        f"({', '.join(files) or 'none'}) are damaged, truncated or missing. This is not a network "
                        "problem: copy or save the pipeline again (`pipe.save_pretrained(DIR)`).")


def check_weights_readable(folder: Path) -> None:
    """Each safetensors file of a model folder has a readable header (a truncated or corrupt file is caught here,
    before any work, rather than when its weights are first needed minutes later). Reads headers only."""
    from safetensors import safe_open

    for weights in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as opened:
                opened.keys()
        except Exception as error:
            raise damaged_component(folder, error) from None


def load_pipeline(model: Any, *, torch_dtype: torch.dtype = torch.float32, lazy: bool = False, controlnet=None,
                  tiny_vae=None):
    """A diffusers pipeline from a folder, a hub id (when online) or a live pipeline.

    With `lazy` (folders only), the torch models are built on the meta device in `torch_dtype`;
    :func:`real_module` loads one, in that dtype, when its weights are needed. `controlnet` (ControlNet folders
    or models, one or a list, see :func:`load_controlnets`) makes it the family's ControlNet pipeline of the same
    task; `tiny_vae` (an AutoencoderTiny or its folder) replaces its VAE (see :func:`with_tiny_vae`)."""
    from diffusers import DiffusionPipeline

    hush_loaded_libraries()  # a CLI's quiet: diffusers' loading bars are set once it is imported
    if isinstance(model, DiffusionPipeline):
        pipe = model
    else:
        source = _source(model)
        folder = Path(source) if Path(source).is_dir() else None
        empty = _meta_models(folder, torch_dtype) if lazy and folder else {}
        try:
            pipe = DiffusionPipeline.from_pretrained(source, dtype=torch_dtype, use_safetensors=True, **{
                **(_absent_components(folder) if folder else {}), "safety_checker": None, **empty})
        except KasokuError:
            raise
        except Exception as error:  # a damaged file in a local folder: name it (diffusers may blame the network)
            if not Path(source).is_dir():
                raise
            raise damaged_component(Path(source), error) from None
        pipe.set_progress_bar_config(disable=True)
    family = family_of(pipe)  # an unsupported pipeline class fails here, naming the supported ones
    if controlnet is not None:
        pipe = family.with_controlnet(pipe, load_controlnets(controlnet, lazy=lazy))
    if tiny_vae is not None:
        pipe = with_tiny_vae(pipe, tiny_vae, lazy=lazy)
    return pipe


def _controlnet_architectures() -> tuple[Any, ...]:
    """The ControlNet architecture modules some family runs, once each (U-Net, SD3, Flux)."""
    return tuple(dict.fromkeys(f.controlnet_architecture for f in FAMILIES.values() if f.controlnet_architecture))


def controlnet_classes() -> tuple[str, ...]:
    """The diffusers ControlNet classes some family runs (ControlNetModel, SD3ControlNetModel, FluxControlNetModel)."""
    return tuple(architecture.MODEL_CLASS for architecture in _controlnet_architectures())


def _is_controlnet(value: Any) -> bool:
    import diffusers

    return isinstance(value, tuple(getattr(diffusers, name) for architecture in _controlnet_architectures()
                                   for name in (architecture.MODEL_CLASS, architecture.MULTI_CLASS)))


def load_controlnets(controlnet: Any, *, lazy: bool = False):
    """ControlNet models from folders (or live models): one, or a list for several (diffusers' MultiControlNet).

    With `lazy`, a folder's model is built on the meta device and loaded when its weights are needed."""
    if isinstance(controlnet, (list, tuple)):
        if not controlnet:
            raise NotADiffusersPipeline("`controlnet` is an empty list; give one ControlNet or several.")
        if len(controlnet) == 1:
            return load_controlnets(controlnet[0], lazy=lazy)
        return [load_controlnets(one, lazy=lazy) for one in controlnet]
    if _is_controlnet(controlnet):
        return controlnet
    if not isinstance(controlnet, (str, Path)):
        raise NotADiffusersPipeline(f"`controlnet` must be a ControlNet folder or a diffusers ControlNetModel (or a "
                                    f"list of them) but is a {type(controlnet).__name__}.")
    folder = Path(controlnet).expanduser()
    if not folder.exists() and _looks_like_hub_id(str(controlnet)) and not _hub_offline():
        import diffusers

        config = diffusers.ControlNetModel.load_config(str(controlnet))  # says its class (SD3ControlNetModel...)
        cls = getattr(diffusers, _controlnet_class_name(config.get("_class_name"), str(controlnet)))
        return cls.from_pretrained(str(controlnet), torch_dtype=torch.float32).eval()
    return _controlnet_from_folder(folder, lazy)


def _controlnet_class_name(name: str | None, where: str) -> str:
    if name not in controlnet_classes():
        raise NotADiffusersPipeline(f"{where} holds a {name!r}, not a ControlNet kasoku runs; kasoku runs "
                                    f"{', '.join(controlnet_classes())} (SD 1.x, 2.x and XL's, SD3's, Flux.1's).")
    return name


def _controlnet_from_folder(folder: Path, lazy: bool):
    import diffusers

    name = None
    if (folder / "config.json").is_file():
        name = _controlnet_class_name(diffusers.ControlNetModel.load_config(folder).get("_class_name"), str(folder))
    return _model_from_folder(folder, getattr(diffusers, name or "ControlNetModel"), "ControlNet", lazy,
                              saved="`controlnet.save_pretrained(DIR)`, or `kasoku tiny DIR --controlnet` writes "
                                    "one in DIR/controlnet",
                              runs=f"the ControlNets diffusers loads as {', '.join(controlnet_classes())}")


def _model_from_folder(folder: Path, cls: type, what: str, lazy: bool, *, saved: str, runs: str):
    """The diffusers model of class `cls` saved in `folder` (`what` names it in errors; `saved` says how such a
    folder is made, `runs` what kasoku takes); with `lazy`, built on the meta device and loaded when needed."""
    if not folder.exists():
        raise ModelNotFound(f"the {what} folder {folder} does not exist"
                            + (" (and HF_HUB_OFFLINE is set, so it is not downloaded)." if _hub_offline() else "."))
    if not (folder / "config.json").is_file():
        raise ModelNotFound(f"{folder} is not a {what} folder (it has no config.json); give a folder a diffusers "
                            f"{cls.__name__} was saved to ({saved}).")
    class_name = cls.load_config(folder).get("_class_name")
    if class_name != cls.__name__:
        raise NotADiffusersPipeline(f"{folder} holds a {class_name!r}, not a {cls.__name__}; kasoku runs {runs}.")
    if not lazy:
        try:
            return cls.from_pretrained(folder, use_safetensors=True, torch_dtype=torch.float32).eval()
        except Exception as error:  # a damaged weights file: name it (not a network problem)
            raise damaged_component(folder, error) from None
    from accelerate import init_empty_weights

    check_weights_readable(folder)
    with init_empty_weights():
        module = cls.from_config(cls.load_config(folder))
    setattr(module, _LAZY_SOURCE, folder)
    return module.eval()


def load_tiny_vae(source: Any, *, lazy: bool = False):
    """An AutoencoderTiny (TAESD, TAESDXL, TAESD3, TAEF1) from its folder, or a live one."""
    from diffusers import AutoencoderTiny

    if isinstance(source, AutoencoderTiny):
        return source
    if isinstance(source, torch.nn.Module):
        raise NotADiffusersPipeline(f"`tiny_vae` must be a diffusers AutoencoderTiny (TAESD) or its folder but is a "
                                    f"{type(source).__name__}.")
    return _model_from_folder(Path(source), AutoencoderTiny, "tiny VAE", lazy,
                              saved="`vae.save_pretrained(DIR)`, or `kasoku tiny DIR --tiny-vae` writes one in "
                                    "DIR/tiny_vae",
                              runs="the tiny autoencoders diffusers loads as AutoencoderTiny (TAESD and its kin)")


def with_tiny_vae(pipe, source: Any, *, lazy: bool = False):
    """A pipeline of `pipe`'s class and components with its VAE swapped for the AutoencoderTiny at `source`
    (`pipe` itself is left as it is). Its latents must be the VAE's: TAESD for SD 1.x/2.x, TAESDXL for SDXL,
    TAESD3 and TAEF1 (16 channels) for SD3 and Flux."""
    tiny = load_tiny_vae(source, lazy=lazy)
    want, have = pipe.vae.config.latent_channels, tiny.config.latent_channels
    if want != have:
        raise NotADiffusersPipeline(f"the tiny VAE has {have} latent channels but this pipeline's VAE has {want}; "
                                    "give the tiny VAE of its family (TAESD for SD 1.x/2.x, TAESDXL for SDXL, TAESD3 "
                                    "for SD3, TAEF1 for Flux).")
    new = from_pipe(type(pipe), pipe, vae=tiny)
    new.set_progress_bar_config(disable=True)
    return new


def _model_classes(folder: Path) -> dict[str, type]:
    """The torch model classes of a folder's components (from model_index.json)."""
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    classes = {}
    for name, value in read_model_index(folder).items():
        if not (isinstance(value, list) and len(value) == 2 and value[0] in ("diffusers", "transformers")):
            continue
        cls = getattr(importlib.import_module(value[0]), value[1], None)
        if isinstance(cls, type) and issubclass(cls, (ModelMixin, PreTrainedModel)):
            classes[name] = cls
    return classes


def _absent_components(folder: Path) -> dict[str, None]:
    """The components the folder's model_index.json lists as absent ([null, null]: a pipeline saved with
    `text_encoder=None`, say), which diffusers' from_pretrained wants passed as None again."""
    return {name: None for name, entry in read_model_index(folder).items()
            if isinstance(entry, list) and entry and entry[0] is None}


def _meta_models(folder: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.nn.Module]:
    """Each torch model of the folder built from its config on the meta device in `dtype` (no weights read)."""
    from accelerate import init_empty_weights
    from diffusers import ModelMixin

    models = {}
    for name, cls in _model_classes(folder).items():
        check_weights_readable(folder / name)
        with init_empty_weights():
            if issubclass(cls, ModelMixin):
                module = cls.from_config(cls.load_config(folder / name))
            else:
                module = cls(cls.config_class.from_pretrained(folder / name))
        setattr(module, _LAZY_SOURCE, folder / name)
        models[name] = module.to(dtype).eval()
    return models


def in_compiled_dtypes(pipe, *, keeps_bf16: bool):
    """`pipe`, or a pipeline of its class on the same components where each torch module kasoku does not compile
    in its own dtype is in float32. bf16 stays bf16 where the graphs come from recorded calls (`keeps_bf16`: a
    generic family's graph takes, computes and gives the dtypes its module was called with, at half the memory of
    fp32); the hand-written architectures' graphs are written in fp32, and fp16 has no fast path on a CPU. A module
    still on the meta device is relabelled (its weights are then read in fp32); a loaded one is copied, so the
    user's pipeline keeps its modules as they are."""
    copies = {}
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        dtype = floating_dtype(module)
        if dtype == torch.float32 or (dtype == torch.bfloat16 and keeps_bf16):
            continue
        if lazy_source(module) is not None:
            module.to(torch.float32)  # kasoku's own meta-device stand-in: nothing to read or copy
        else:
            copies[name] = copy.deepcopy(module).to(torch.float32)
    return from_pipe(type(pipe), pipe, **copies) if copies else pipe


def lazy_source(module: Any) -> Path | None:
    """The folder a lazily loaded module's weights come from (None for a module given to kasoku)."""
    return getattr(module, _LAZY_SOURCE, None)


def _put_module(pipe, path: str, module: torch.nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    if parent:
        setattr(module_at(pipe, parent), name, module)
    else:
        pipe.register_modules(**{name: module})


def real_module(pipe, attribute: str) -> torch.nn.Module:
    """The module at `attribute` (a dotted path, see :func:`module_at`) with its weights: loaded from
    its folder (and put on `pipe`), in the stand-in's dtype, when it is still a meta-device stand-in."""
    module = module_at(pipe, attribute)
    source = lazy_source(module)
    if source is None:
        return module
    cls = type(module)
    dtype_argument = "torch_dtype" if cls.__module__.startswith("diffusers") else "dtype"
    hush_loaded_libraries()  # transformers, imported by now, shows a bar per weights file unless told
    try:
        real = cls.from_pretrained(source, use_safetensors=True, **{dtype_argument: floating_dtype(module)}).eval()
    except Exception as error:  # safetensors, transformers and diffusers raise many kinds on a damaged folder
        raise damaged_component(source, error) from None
    setattr(real, _LOADED_LAZILY, source)
    _put_module(pipe, attribute, real)
    return real


def own_module(pipe, attribute: str) -> torch.nn.Module:
    """The module at `attribute` with its weights, from now on changed in memory (an IP-Adapter loaded into it):
    never released back to its folder, and hashed from memory."""
    module = real_module(pipe, attribute)
    if hasattr(module, _LOADED_LAZILY):
        delattr(module, _LOADED_LAZILY)
    return module


def release_module(pipe, attribute: str) -> None:
    """Drop the weights of a module kasoku loaded lazily (once its engines are built), keeping a
    meta-device stand-in that can load them again. A module given to kasoku is left alone."""
    module = module_at(pipe, attribute)
    source = getattr(module, _LOADED_LAZILY, None)
    if source is None:
        return
    from accelerate import init_empty_weights
    from diffusers import ModelMixin

    with init_empty_weights():
        empty = type(module).from_config(module.config) if isinstance(module, ModelMixin) else \
            type(module)(module.config)
    setattr(empty, _LAZY_SOURCE, source)
    _put_module(pipe, attribute, empty.to(floating_dtype(module)).eval())
