"""Tests of kasoku.batch (src/kasoku/batch/)."""
