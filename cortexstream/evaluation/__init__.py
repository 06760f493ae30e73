"""Quality evaluation: perplexity with a KV policy active (`perplexity`, `token_nlls`)."""
