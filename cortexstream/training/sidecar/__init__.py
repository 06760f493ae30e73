"""Training the force-matched sidecar: trajectories, loss, trainer, held-out scores, comparison and its CLI."""
