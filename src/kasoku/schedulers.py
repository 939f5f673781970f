"""Short scheduler names for the CLI and `KasokuPipeline.set_scheduler` -> diffusers classes."""

SCHEDULERS = {
    "ddim": "DDIMScheduler",
    "pndm": "PNDMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler-ancestral": "EulerAncestralDiscreteScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "lms": "LMSDiscreteScheduler",
}


def most_steps(scheduler) -> int:
    """The most denoising steps `scheduler` runs: its training steps, less what its own timesteps would
    overrun (with a steps_offset, "leading" spacing at as many steps as training steps asks for one past
    the last; diffusers then fails mid-call)."""
    trained = int(scheduler.config.num_train_timesteps)
    trial = type(scheduler).from_config(scheduler.config)
    for steps in range(trained, max(trained - 64, 0), -1):
        try:
            trial.set_timesteps(steps)
        except ValueError:
            continue
        if float(trial.timesteps.max()) < trained:
            return steps
    return trained
