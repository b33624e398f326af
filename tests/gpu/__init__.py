"""Tests that need a CUDA device (marked `gpu`, skipped without one); each has a CPU test of the same logic."""
