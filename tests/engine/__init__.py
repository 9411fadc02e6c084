"""Tests of raylign.engine."""
