"""`kasoku info`: versions, backends and devices, and why a backend is unavailable."""

from __future__ import annotations

import platform
from importlib import metadata

from ..backends import backend_availability
from ..backends.base import cpu_name, gpu_identity
from ..core.extras import installed_ort_distributions, ort_conflict

PACKAGES = ("kasoku", "torch", "diffusers", "transformers", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu",
            "onnx-graphsurgeon", "openvino", "tensorrt", "polygraphy", "xformers")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def system_info() -> dict:
    import torch

    gpus = []
    if torch.cuda.is_available():
        gpus = [str(gpu_identity(i)) for i in range(torch.cuda.device_count())]
    conflict = ort_conflict(installed_ort_distributions())
    return {
        "python": platform.python_version(),
        "machine": {"cpu": cpu_name(), "cores": torch.get_num_threads(), "gpus": gpus},
        "versions": package_versions(),
        "backends": [vars(a) for a in backend_availability()],
        "problems": [conflict] if conflict else [],
    }


def model_components(source) -> dict:
    """`kasoku info MODEL`: the model's family and each component (engine or torch, and why torch), as kasoku
    will compile it (a family compiled from its recorded calls records them first)."""
    from ..model.pipeline_model import Model

    model = Model.load(source, lazy=True, label=str(source))
    family = model.family
    in_torch = family.in_torch(model)
    specs = model.specs(model.default_profile())
    how = "engine, from its recorded calls" if family.generic else "engine, hand-written"
    rows = [{"component": name, "module": type(model.ref(spec.modules[0]).module).__name__, "runs": how}
            for name, spec in specs.items()]
    rows += [{"component": name, "module": "", "runs": f"torch: {reason}"} for name, reason in in_torch.items()]
    return {"model": str(source), "family": family.title, "generic": family.generic, "components": rows}
