"""Seed workflows beside the main path: the multi-level (V-cycle) operators."""
