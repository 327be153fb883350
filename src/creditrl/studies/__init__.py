"""Studies on top of the trainer and the runtime: statistics and reports (reporting), config x
seed comparisons (compare, trainer_runs), the papers' experiments (experiments) and
``creditrl diagnose``."""
