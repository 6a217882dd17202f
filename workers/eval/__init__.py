"""Quality measures of a loaded model: perplexity and KL divergence against a base run."""
