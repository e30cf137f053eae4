"""The job's contracts and the training rules both the planner and the workers follow: the typed spec,
the job states, the worker records, the memory plan (plan.py), presets, model references, data formats,
units, domain errors. No torch, no database."""
