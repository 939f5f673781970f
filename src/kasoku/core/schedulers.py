"""Short scheduler names for the CLI and `KasokuPipeline.set_scheduler` -> diffusers classes.

A model is trained for one kind of noise: the U-Net families' discrete noise schedules (DDPM's betas), or
the flow-matching families' (SD3, Flux) straight paths from noise to data. A scheduler of the other kind
would denoise nonsense, so each name says its kind and only the model's own kind is offered.

The few-step schedulers are the distilled models' own: LCM (LCM-distilled U-Nets and LCM-LoRA), TCD (the
TCD LoRAs) and Euler with "trailing" timestep spacing (SD-Turbo, SDXL-Turbo, SDXL-Lightning, Hyper-SD). With
one of them the commands' steps and guidance default to what diffusers documents for those models
(:func:`few_step_defaults`).
"""

SCHEDULERS = {
    "ddim": "DDIMScheduler",
    "pndm": "PNDMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler-ancestral": "EulerAncestralDiscreteScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "lms": "LMSDiscreteScheduler",
    "lcm": "LCMScheduler",
    "tcd": "TCDScheduler",
    "euler-trailing": "EulerDiscreteScheduler",
    "euler-ancestral-trailing": "EulerAncestralDiscreteScheduler",
    "flow-euler": "FlowMatchEulerDiscreteScheduler",
    "flow-heun": "FlowMatchHeunDiscreteScheduler",
}
# what a name sets in the model's scheduler config besides the class
SCHEDULER_CONFIG = {"euler-trailing": {"timestep_spacing": "trailing"},
                    "euler-ancestral-trailing": {"timestep_spacing": "trailing"}}
FLOW_MATCHING = ("flow-euler", "flow-heun")

# (steps, guidance) diffusers documents for the few-step models each scheduler runs: SD-Turbo / SDXL-Turbo (1 step,
# no guidance), LCM-LoRA (4 steps, guidance 1: no classifier-free guidance), TCD (4 steps, no guidance); an
# LCM-distilled U-Net embeds its guidance scale instead (LatentConsistencyModelPipeline's 8.5, documented at 8).
TRAILING_EULER = ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler")
FEW_STEP = {"LCMScheduler": (4, 1.0), "TCDScheduler": (4, 0.0), "trailing": (1, 0.0)}
LCM_DISTILLED_GUIDANCE = 8.0


def is_flow_matching(scheduler) -> bool:
    """Whether `scheduler` (a diffusers scheduler) moves along flow-matching paths (its class is FlowMatch*)."""
    return type(scheduler).__name__.startswith("FlowMatch")


def schedulers_for(scheduler) -> tuple[str, ...]:
    """The names of the schedulers that fit a model trained for `scheduler`'s kind of noise."""
    flow = is_flow_matching(scheduler)
    return tuple(name for name in SCHEDULERS if (name in FLOW_MATCHING) == flow)


def most_steps(scheduler) -> int:
    """The most denoising steps `scheduler` runs: its training steps, less what its own timesteps would
    overrun (with a steps_offset, "leading" spacing at as many steps as training steps asks for one past
    the last; diffusers then fails mid-call). A flow-matching scheduler runs any number up to its training
    steps."""
    trained = int(scheduler.config.num_train_timesteps)
    if is_flow_matching(scheduler):
        return trained
    distilled = distilled_steps(scheduler)
    if distilled:  # a subset of the schedule it was distilled on
        return min(trained, distilled)
    trial = type(scheduler).from_config(scheduler.config)
    for steps in range(trained, max(trained - 64, 0), -1):
        try:
            trial.set_timesteps(steps)
        except ValueError:
            continue
        if float(trial.timesteps.max()) < trained:
            return steps
    return trained


def distilled_steps(scheduler) -> int | None:
    """The steps of the schedule a consistency-distilled model was trained on (LCM's and TCD's
    `original_inference_steps`): a call runs a subset of them. None for other schedulers."""
    steps = scheduler.config.get("original_inference_steps")
    return int(steps) if steps else None


def scheduler_named(name: str, current):
    """The diffusers scheduler `name` (see SCHEDULERS) with `current`'s config, refused with the reason where it
    is unknown or of the other kind of noise."""
    import diffusers

    from .standins import InvalidInput

    fitting = schedulers_for(current)
    if name not in SCHEDULERS:
        raise InvalidInput(f"unknown scheduler {name!r}; choose from {', '.join(fitting)}.")
    if name not in fitting:
        raise InvalidInput(f"scheduler {name!r} does not fit a model trained for {type(current).__name__}'s kind of "
                           f"noise; choose from {', '.join(fitting)}.")
    return getattr(diffusers, SCHEDULERS[name]).from_config(current.config, **SCHEDULER_CONFIG.get(name, {}))


def few_step_defaults(scheduler, *, guidance_embedded: bool = False) -> tuple[int, float] | None:
    """(steps, guidance) for a few-step scheduler (see FEW_STEP), None for the others. `guidance_embedded`: the
    U-Net embeds the guidance scale (an LCM-distilled one), which then defaults to LCM_DISTILLED_GUIDANCE."""
    name = type(scheduler).__name__
    if name in TRAILING_EULER and scheduler.config.get("timestep_spacing") == "trailing":
        return FEW_STEP["trailing"]
    if name not in FEW_STEP:
        return None
    steps, guidance = FEW_STEP[name]
    return steps, LCM_DISTILLED_GUIDANCE if guidance_embedded else guidance
