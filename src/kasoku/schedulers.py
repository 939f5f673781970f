"""Short scheduler names for the CLI and `KasokuPipeline.set_scheduler` -> diffusers classes."""

SCHEDULERS = {
    "ddim": "DDIMScheduler",
    "pndm": "PNDMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler-ancestral": "EulerAncestralDiscreteScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "lms": "LMSDiscreteScheduler",
}
