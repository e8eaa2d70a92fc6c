"""Distributed Gray-Scott reaction-diffusion and 2-D Navier-Stokes: the training data of the surrogates."""

from .grayscott import GrayScott, initial_state
from .navier_stokes import NavierStokes2D, NSState

__all__ = ["GrayScott", "NSState", "NavierStokes2D", "initial_state"]
