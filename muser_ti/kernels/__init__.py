"""Taichi kernels, one module per kernel family of the chapter."""
