"""Gradient-quality measurement over gradient vectors (no model): the gradient noise scale
(noise_scale) and matched-signal comparisons of estimators."""
