"""The serving engine: sequences, block manager, scheduler (pure Python) and the MLX runner."""
