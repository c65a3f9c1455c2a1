"""Distributed execution: tensor-parallel inference (tp.py); data-parallel training lives beside it."""
