"""The pipeline layer: what a user calls.

:func:`~kasoku.pipeline.compiling.compile_components` runs the policies, then the build;
:class:`~kasoku.pipeline.kasoku_pipeline.KasokuPipeline` and :func:`~kasoku.pipeline.kasoku_pipeline.compile`
make a drop-in pipeline of it, whose calls are checked first (:mod:`.checks`) against diffusers' own call
signature (:mod:`.signature`).

May import: every layer below it (core, architectures, families, model, backends, build, runtime, policies).
"""
