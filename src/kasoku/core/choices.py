"""The choices and defaults the commands offer, torch-free: `kasoku --help` and every argument error answer
before torch, diffusers or a runtime is imported.

Each fact here has one owner that uses it (the family registry, the backend registry, TensorRT's backend, the
tiny builder, batch and serve); the heavy owners check at import that they agree with this module, so a family
or backend added in one place and not here fails at once, naming the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---- families and their components (kasoku.families: the registry) -------------------------------------

FAMILY_TITLES = {"sd1": "Stable Diffusion 1.x", "sd2": "Stable Diffusion 2.x", "sdxl": "Stable Diffusion XL",
                 "sd3": "Stable Diffusion 3", "flux": "Flux.1"}
CONTROLNET_COMPONENT = "controlnet_{}"  # one per distinct ControlNet model: controlnet_0, controlnet_1, ...
# every component some family's pipeline can have (what --components accepts)
COMPONENT_NAMES = ("text_encoder", "unet", "vae_decoder", "vae_encoder", "text_encoder_2", "text_encoder_3",
                   "transformer", "unet_controlnet", "transformer_controlnet", CONTROLNET_COMPONENT.format("<i>"))
PREDICTION_TYPES = ("epsilon", "v_prediction")  # the tiny U-Net families' schedulers


def is_component_name(name: str) -> bool:
    """Whether some family's pipeline can have a component of this name."""
    prefix = CONTROLNET_COMPONENT.format("")
    return name in COMPONENT_NAMES or (name.startswith(prefix) and name[len(prefix):].isdigit())


# ---- backends (kasoku.backends: the registry) ---------------------------------------------------------------

BACKEND_NAMES = ("tensorrt", "onnxruntime", "openvino", "inductor", "torch")
# `onnxruntime-cuda` and `onnxruntime-tensorrt` are onnxruntime with that execution provider.
PROVIDER_ALIASES = {"onnxruntime-cpu": "cpu", "onnxruntime-cuda": "cuda", "onnxruntime-tensorrt": "tensorrt"}
BACKEND_CHOICES = ("auto", *BACKEND_NAMES, *PROVIDER_ALIASES)
TRT_OPT_LEVELS = range(0, 6)  # TensorRT's builder optimization levels
TUNE_PRECISIONS = ("fp32", "bf16", "int8")  # what `kasoku tune` tries by default (kasoku.tools.tune)

# ---- batch and serve ----------------------------------------------------------------------------------------

DEFAULT_BATCH_SIZE = 4  # images per engine call
DEFAULT_STEPS = 30  # a job's or request's steps and guidance where its model's family gives none
DEFAULT_GUIDANCE = 7.5
DEFAULT_WINDOW_MS = 20.0  # how long the oldest waiting image waits for companions (under load, calls run back to back)
DEFAULT_MAX_QUEUE = 64  # images waiting for an engine call
DEFAULT_TIMEOUT = 600.0  # seconds from a request's arrival to its answer (a full-size image on a CPU takes a minute)
LOG_LEVELS = ("debug", "info", "warning", "error")
SIZE_PATTERN = re.compile(r"(\d+)x(\d+)")


@dataclass(frozen=True)
class Size:
    """An image size as the OpenAI API writes it: "WxH" (width first)."""

    width: int
    height: int

    @classmethod
    def parse(cls, text: str) -> Size:
        match = SIZE_PATTERN.fullmatch(text.strip())
        if not match or min(int(match[1]), int(match[2])) < 1:
            raise ValueError(f"a size is WIDTHxHEIGHT in pixels, e.g. 512x512, not {text!r}")
        return cls(int(match[1]), int(match[2]))

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"

# the tiny families `kasoku tiny --family` builds of the pipelines compiled from their recorded calls
# (kasoku/tools/tiny_families.py checks at import that its builders are these)
RECORDED_TINY_FAMILIES = ("pixart-sigma", "auraflow", "chroma", "sana", "sana-sprint", "lumina2", "cogview4",
                          "z-image", "flux2-klein", "qwen-image", "ovis-image", "bria", "flux2", "hunyuan-image",
                          "krea2", "longcat-image", "ernie-image", "cogview3-plus", "hunyuan-dit", "kandinsky3",
                          "pixart-alpha", "lcm", "lumina", "kandinsky5", "hidream", "bria-fibo", "bria-fibo2",
                          "nucleus-moe-image", "ideogram4", "prx", "dreamlite", "dreamlite-mobile", "ldm",
                          "deepfloyd-if", "stable-unclip")
