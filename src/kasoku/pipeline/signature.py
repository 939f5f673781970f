"""diffusers' own call signature on a compiled pipeline: the parameters of the pipeline classes it runs.

A KasokuPipeline serves every task of its model (txt2img, img2img, inpaint), each through the family's
diffusers pipeline of that task, so its signature is theirs: first the parameters of the class it was
compiled from, with their names, kinds and defaults, then those only the other tasks' classes take
(keyword-only), then kasoku's own additions (keyword-only). `inspect.signature(fast)` shows it, and a call
with a name no class takes is refused before anything runs (diffusers swallows unknown keywords into its
deprecated **kwargs and ignores them: a silently wrong image).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..core.standins import InvalidInput

if TYPE_CHECKING:
    from ..model.pipeline_model import Model

# what diffusers' pipelines still take through **kwargs (deprecated, with a warning)
DEPRECATED = ("callback", "callback_steps")
# kasoku's own call arguments, and what they default to
KASOKU_ARGUMENTS = {"control_image": None, "cache_interval": 1, "cache_schedule": "uniform", "cache_method": None,
                    "cache_threshold": None, "cache_order": None, "cache_warmup": None}


def pipeline_classes(model: Model) -> list[type]:
    """The class the model's pipeline is, then the family's classes of the other tasks (ControlNet ones with
    ControlNets)."""
    return model.pipeline_classes()


def call_signature(model: Model, extras: Mapping[str, Any] = KASOKU_ARGUMENTS) -> inspect.Signature:
    """The signature described in the module docstring."""
    classes = pipeline_classes(model)
    own = [p for p in _parameters(classes[0]) if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    seen = {p.name for p in own}
    keyword_only = []
    for cls in classes[1:]:
        for p in _parameters(cls):
            if p.name not in seen and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                keyword_only.append(p.replace(kind=p.KEYWORD_ONLY))
                seen.add(p.name)
    for name, default in extras.items():
        if name not in seen:
            keyword_only.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))
    positional = [p for p in own if p.kind != p.KEYWORD_ONLY]
    own_keyword = [p for p in own if p.kind == p.KEYWORD_ONLY]
    return inspect.Signature([*positional, *own_keyword, *keyword_only])


def _parameters(cls: type) -> Iterable[inspect.Parameter]:
    return list(inspect.signature(cls.__call__).parameters.values())[1:]  # without self


def check_names(signature: inspect.Signature, given: Iterable[str], classes: Iterable[type]) -> None:
    """Refuse a call argument no class of this pipeline takes, naming the nearest one it does."""
    known = set(signature.parameters) | set(DEPRECATED)
    for name in given:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean `{near[0]}`?" if near else ""
            raise InvalidInput(f"`{name}` is not an argument of this pipeline (diffusers' "
                               f"{', '.join(c.__name__ for c in classes)}){hint}")


def check_task_names(task: str, pipeline_class: type, given: Mapping[str, Any]) -> None:
    """Refuse an argument the task's own class does not take (`strength` in a text-to-image call: diffusers would
    take it into its deprecated **kwargs and ignore it). One given as None asks for nothing and passes."""
    takes = takes_names(pipeline_class)
    for name, value in given.items():
        if name not in takes and value is not None:
            raise InvalidInput(f"`{name}` does not apply to {task} ({pipeline_class.__name__} takes no `{name}`); "
                               f"{_where_it_applies(name)}")


class IgnoredArgument(UserWarning):
    """A call argument the task's diffusers class takes into its **kwargs and ignores, as diffusers does."""


# The sizes an input image fixes: diffusers' image-to-image classes that take no `height`/`width` ignore them (code
# sharing one argument dict between tasks passes them). Not `strength` in a text-to-image call: giving it means an
# image was meant, and the call would silently make another kind of image.
IMAGE_SIZED = ("height", "width")


def ignored_arguments(task: str, pipeline_class: type, given: Mapping[str, Any]) -> list[str]:
    """The arguments of `given` the task's class swallows into its **kwargs and ignores (see IMAGE_SIZED)."""
    parameters = _parameters(pipeline_class)
    if task == "txt2img" or not any(p.kind == p.VAR_KEYWORD for p in parameters):
        return []
    takes = {p.name for p in parameters}
    return [name for name in IMAGE_SIZED if given.get(name) is not None and name not in takes]


def takes_names(pipeline_class: type) -> set[str]:
    """The call arguments `pipeline_class` takes by name."""
    return {p.name for p in _parameters(pipeline_class)} | set(DEPRECATED)


def applicable(pipeline_class: type, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` without the None-valued ones `pipeline_class` does not take (LatentConsistencyModelPipeline has no
    `negative_prompt`; code written for another class may pass it as None)."""
    takes = takes_names(pipeline_class)
    return {name: value for name, value in kwargs.items() if name in takes or value is not None}


def _where_it_applies(name: str) -> str:
    return {"strength": "give `image` for img2img (and `mask_image` to inpaint) or leave it out.",
            "mask_image": "give `image` with it to inpaint."}.get(name, "leave it out for this task.")
