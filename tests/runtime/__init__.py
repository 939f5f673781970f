"""Tests of kasoku.runtime (src/kasoku/runtime/)."""
