"""Tests of kasoku.cli (src/kasoku/cli/)."""
