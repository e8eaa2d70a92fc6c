"""Distributed convolutional surrogates (residual CNN, U-Net) of the Gray-Scott fields."""

from .models import build_model

__all__ = ["build_model"]
