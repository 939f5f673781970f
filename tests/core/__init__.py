"""Tests of kasoku.core (src/kasoku/core/)."""
