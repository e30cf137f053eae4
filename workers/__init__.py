"""What runs inside Ray: the job driver, one module per strategy, models, data, PEFT, checkpoints, telemetry, sinks."""
