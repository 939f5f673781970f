"""The build layer: one component spec in, a proven engine out, every artefact a cache entry.

:mod:`.export` writes the architecture graph (weights as named inputs, under exportable attention),
:mod:`.optimize` runs the graph passes a backend asks for, and :class:`~kasoku.build.compiler.Compiler`
chains export → optimize → engine through the cache and proves each engine against torch.

May import: the core, architectures, families, model and backends.
"""
