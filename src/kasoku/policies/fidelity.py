"""What every fidelity measure shares: the fixed prompts and seed, and the images a call takes besides its
prompt. `kasoku verify`, ``precision="fastest"`` (and the benchmarks) hold images to one another with these,
so that the same latents and inputs go into every pipeline that is compared.
"""

from __future__ import annotations

import numpy as np

from ..core.components import ImageShape
from ..model.pipeline_model import Model

VERIFY_PROMPT = "a photo of an astronaut riding a horse on mars"
VERIFY_SEED = 0
# A lower precision's images are held to the fp32 engines' on these prompts (the fidelity contract).
FIDELITY_PROMPTS = (VERIFY_PROMPT, "a watercolor painting of a red fox in the snow",
                    "a photograph of a lighthouse at sunset, detailed")


def contract_steps(model: Model, task: str, steps: int) -> int:
    """A contract's denoising `steps`, or the model's pipeline's own default where that is fewer: a distilled
    pipeline may take no other count (Sana Sprint's SCM scheduler takes exactly its 2)."""
    import inspect

    parameter = inspect.signature(type(model.task_pipeline(task)).__call__).parameters.get("num_inference_steps")
    default = getattr(parameter, "default", None)
    fewer = isinstance(default, int) and not isinstance(default, bool) and 0 < default < steps
    return default if fewer else steps


def seeded_call(pipe, prompt, seed: int, **kwargs):
    """`pipe(prompt, **kwargs)` with a generator of `seed`, and torch's global generator at `seed` for the call
    (restored after it): diffusers' SD3 ControlNet pipeline samples its control image's latents from the global one,
    so pipelines compared must start it alike."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return pipe(prompt, generator=torch.Generator().manual_seed(seed), **kwargs)


def random_image(shape: ImageShape, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (shape.height, shape.width, 3), dtype=np.uint8))


def inpaint_inputs(shape: ImageShape) -> dict:
    """An inpainting call inpaints a square of a random image."""
    from PIL import Image

    size = shape.height, shape.width
    mask = np.zeros(size, dtype=np.uint8)
    mask[size[0] // 4: 3 * size[0] // 4, size[1] // 4: 3 * size[1] // 4] = 255
    return {"image": random_image(shape, VERIFY_SEED), "mask_image": Image.fromarray(mask)}


def task_inputs(model: Model, task: str, shape: ImageShape) -> dict:
    """The images a call of `task` takes besides the prompt, as KasokuPipeline takes them: inpainting's
    image and mask, a random control image per ControlNet where the pipeline has ControlNets, and a random image
    prompt per IP-Adapter where it has IP-Adapters."""
    inputs = inpaint_inputs(shape) if task == "inpaint" else {}
    if model.controlnets:
        images = [random_image(shape, VERIFY_SEED + 1 + i) for i in range(model.controlnets)]
        inputs["control_image"] = images[0] if model.controlnets == 1 else images
    adapters = len(model.family.ip_adapters(model))
    if adapters:  # one random image prompt per IP-Adapter
        prompts = [random_image(shape, VERIFY_SEED + 11 + i) for i in range(adapters)]
        inputs["ip_adapter_image"] = prompts[0] if adapters == 1 else prompts
    return inputs


def diffusers_inputs(model: Model, task: str, inputs: dict) -> dict:
    """`inputs` of :func:`task_inputs` as the family's diffusers pipeline of `task` takes them."""
    inputs = dict(inputs)
    if "control_image" in inputs:
        inputs.update(model.family.control_arguments(task, inputs.pop("control_image")))
    return inputs
