"""Kernel-backed ops, one module per family."""
