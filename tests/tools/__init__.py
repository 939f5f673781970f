"""Tests of kasoku.tools (src/kasoku/tools/)."""
