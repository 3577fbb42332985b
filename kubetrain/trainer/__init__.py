"""kubetrain's data plane: data, models, checkpoints, metrics and the trainer entry points."""
