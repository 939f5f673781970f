"""Tests of kasoku.backends (src/kasoku/backends/)."""
