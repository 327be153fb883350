"""Gradient quality at matched signal, as pure tensor math (no model): streaming sufficient statistics
of several estimators' gradients on the same draws (``moments``), their variance, scale, alignment
and relative efficiency with intervals (``quality``), the gradient noise scale (``noise_scale``) and a
count sketch for gradients too large to keep (``sketch``). The model side (one group's exact
gradient under every estimator) is ``creditrl.runtime.group_gradients``."""
from creditrl.core.gradients.moments import GradientMoments, GradientStats, moments_from_draws
from creditrl.core.gradients.noise_scale import NoiseScale, noise_scale_terms, prompt_noise_scale
from creditrl.core.gradients.quality import (EstimatorQuality, Interval, exact_multiples, exact_quality,
                                            gradient_quality, signal_interval)
from creditrl.core.gradients.sketch import CountSketch

__all__ = ["GradientMoments", "GradientStats", "moments_from_draws", "NoiseScale", "noise_scale_terms", "prompt_noise_scale",
           "EstimatorQuality", "Interval", "exact_multiples", "exact_quality", "gradient_quality", "signal_interval",
           "CountSketch"]
