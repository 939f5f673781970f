"""The tools layer: library calls that return data, one per command beside the build.

verify (:mod:`.verification`), bench (:mod:`.benchmark`), tune (:mod:`.tune`), demo (:mod:`.demo`), info
(:mod:`.info`) and the built-in tiny pipelines' writer (:mod:`.tiny`).

May import: every layer below it, the pipeline layer included; never the apps.
"""
