"""Distributed Gray-Scott reaction-diffusion: the training data of the surrogates."""

from .grayscott import GrayScott, initial_state

__all__ = ["GrayScott", "initial_state"]
