"""Model runtime: loading policies (models), sampling (sampling, rollout), scoring responses
(scoring), held-out evaluation (evaluation) and building all of them from a config (setup).
Built on the library (``creditrl.core``) and the tasks."""
