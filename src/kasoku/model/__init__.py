"""The model layer: a diffusers pipeline as kasoku compiles it.

:class:`~kasoku.model.pipeline_model.Model` holds the pipeline, its family (detected once), lazy loading
(:mod:`.loading`: modules on the meta device until their weights are needed) and the weight digests
(:mod:`.fingerprint`). The layers above pass a Model around and ask it, instead of a pipeline.

May import: the core, architectures and families.
"""
