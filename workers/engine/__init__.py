"""A compact PyTorch inference engine for the Llama family (Llama 1/2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM)."""
