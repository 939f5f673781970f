"""Tests of kasoku.serve (src/kasoku/serve/)."""
