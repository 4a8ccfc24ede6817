"""Training: the DeepSpeed engine, the schedule, checkpoints and the loop."""
