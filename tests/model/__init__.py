"""Tests of kasoku.model (src/kasoku/model/)."""
