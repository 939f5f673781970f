"""Short scheduler names for the CLI and `KasokuPipeline.set_scheduler` -> diffusers classes.

A model is trained for one kind of noise: the U-Net families' discrete noise schedules (DDPM's betas), or
the flow-matching families' (SD3, Flux) straight paths from noise to data. A scheduler of the other kind
would denoise nonsense, so each name says its kind and only the model's own kind is offered.
"""

SCHEDULERS = {
    "ddim": "DDIMScheduler",
    "pndm": "PNDMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler-ancestral": "EulerAncestralDiscreteScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "lms": "LMSDiscreteScheduler",
    "flow-euler": "FlowMatchEulerDiscreteScheduler",
    "flow-heun": "FlowMatchHeunDiscreteScheduler",
}
FLOW_MATCHING = ("flow-euler", "flow-heun")


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
    trial = type(scheduler).from_config(scheduler.config)
    for steps in range(trained, max(trained - 64, 0), -1):
        try:
            trial.set_timesteps(steps)
        except ValueError:
            continue
        if float(trial.timesteps.max()) < trained:
            return steps
    return trained


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
    return getattr(diffusers, SCHEDULERS[name]).from_config(current.config)
