"""Tests of kasoku.families (src/kasoku/families/)."""
