"""`cortexstream tui`: chat with several conversations at once and watch the KV block arena live."""
