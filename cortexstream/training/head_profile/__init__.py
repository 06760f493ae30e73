"""Measuring a model's head profile (`policies.head_profile`, for `KVzipHeads`) and its CLI."""
