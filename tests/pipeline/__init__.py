"""Tests of kasoku.pipeline (src/kasoku/pipeline/)."""
