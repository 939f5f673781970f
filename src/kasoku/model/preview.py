"""A model folder seen through its JSON configs alone: what the checks before any work need (its family, size
step and native size) in about a second, before diffusers is imported or a module is built.

A command checks its arguments against a :class:`ConfigPreview` first and loads the :class:`~kasoku.model.
pipeline_model.Model` only when they pass: a wrong size or another family's flag is refused at once, even on a busy
machine. The facts come from the same family methods a Model answers through; where configs alone cannot say (a
hub id, a family compiled from recorded calls, whose size step is learnt from a call), there is no preview and the
Model's checks answer instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..architectures.base import ModuleRef
from ..families import Family, detect_family

__all__ = ["ConfigPreview"]


class _Config(dict):
    """A config.json as diffusers' FrozenDict reads: by key and by attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _configs_only(path: str) -> Any:
    raise RuntimeError(f"a config preview has no weights for {path}: load the Model")


@dataclass
class ConfigPreview:
    """A diffusers folder's family and component configs (a :class:`~kasoku.families.base.ModelView`)."""

    folder: Path
    family: Family
    configs: dict[str, _Config]
    pipe: Any = None
    memo: dict[str, Any] = field(default_factory=dict)
    recordings: Any = None  # a preview records nothing

    @classmethod
    def of(cls, source: Any) -> ConfigPreview | None:
        """The preview of a folder of a hand-written family, else None (a hub id, a live pipeline, a generic family,
        or a folder that is not a whole pipeline, whose error the Model's loading words)."""
        if not isinstance(source, (str, Path)) or not (Path(source) / "model_index.json").is_file():
            return None
        folder = Path(source)
        try:
            family = detect_family(folder)
            configs = {p.name: _Config(json.loads((p / "config.json").read_text())) for p in folder.iterdir()
                       if (p / "config.json").is_file()}
        except Exception:  # noqa: BLE001 - the Model's loading says what is wrong with the folder
            return None
        if family.generic or not {family.denoiser, family.vae} <= configs.keys():
            return None  # a folder without its denoiser or VAE: the Model's loading names what is missing
        return cls(folder, family, configs)

    def ref(self, path: str) -> ModuleRef:
        if path not in self.configs:
            raise KeyError(f"{self.folder} has no {path}/config.json")
        return ModuleRef(path, SimpleNamespace(config=self.configs[path]), load=lambda: _configs_only(path),
                         digest=lambda: _configs_only(path))

    @property
    def native_size(self) -> int:
        return self.family.native_size(self)

    @property
    def pixel_multiple(self) -> int:
        return self.family.pixel_multiple(self)
