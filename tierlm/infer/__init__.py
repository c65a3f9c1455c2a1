"""Inference: generation with streamed weights."""
