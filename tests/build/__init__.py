"""Tests of kasoku.build (src/kasoku/build/)."""
