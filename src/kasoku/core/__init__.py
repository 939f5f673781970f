"""The core layer: what every other layer stands on, and imports nothing of kasoku's above it.

Shapes and component specs (:mod:`.components`), options (:mod:`.options`), errors, the content-addressed
cache (:mod:`.cache`), exportable attention (:mod:`.attention`), graph weights by name (:mod:`.weights`), the
tolerance table (:mod:`.parity`), free memory and its guard (:mod:`.memory`), schedulers by name, step-cache
schedules (:mod:`.step_cache`), the stand-ins' base (:mod:`.standins`), and the names the CLI offers without
importing torch (:mod:`.choices`, :mod:`.precision`).

May import: only the core itself (and third-party packages).
"""
