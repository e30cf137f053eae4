"""The memory planner: model shapes, GPUs, the per-rank prediction by category, suggestions, the
pre-flight policy, predicted against measured, and out-of-memory post-mortems."""
