"""Tests that need a CUDA device."""
