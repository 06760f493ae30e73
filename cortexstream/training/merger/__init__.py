"""Training the merger of evicted tokens (`cortexstream train merger`)."""
