"""One module per strategy, mirroring workers/strategies/: each says what its rank holds of the model states
and which communication buffers and gathered parameters it adds, at which instant of a step
(terms.py: StrategyTerms). service/memory/planner.py composes them with the activations."""
