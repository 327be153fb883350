"""The library: pure functions over tensors. Group reductions (groups), per-token statistics
(token_stats), advantage estimators (estimators), policy losses (losses) and gradient-quality
measurement (gradients). Imports nothing above it."""
