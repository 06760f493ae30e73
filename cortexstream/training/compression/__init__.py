"""Training a FastCache-style KV compressor: objective, teacher data, trainer, `cortexstream train compressor`."""
