"""Tests of kasoku.policies (src/kasoku/policies/)."""
