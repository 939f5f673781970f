"""One module per model architecture: its spec builders (inputs, outputs, dynamic axes), the torch wrapper
export traces, and the engine stand-in diffusers calls in its place.

An architecture module takes modules and configs (a :class:`~kasoku.architectures.base.ModuleRef`), never the
pipeline, and imports only kasoku's core (shapes, specs, options, errors, stand-in base) and, where one
architecture builds on another, that architecture's module (the ControlNet's residuals are the U-Net's).
Families (:mod:`kasoku.families`) compose them into pipelines.

- :mod:`.clip`: CLIP text encoders (last or penultimate hidden state, pooled and projected embeddings)
- :mod:`.unet`: UNet2DConditionModel (plain, with a ControlNet's residuals as inputs)
- :mod:`.deepcache`: the U-Net's step-cache graphs (DeepCache's full and shallow)
- :mod:`.controlnet`: ControlNetModel (one, or diffusers' MultiControlNetModel over several)
- :mod:`.vae`: AutoencoderKL's decoder and encoder
- :mod:`.tiny`: the building blocks of the built-in tiny models

The architectures layer. May import: the core only (and one architecture module another).
"""
