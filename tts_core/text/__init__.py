"""Text frontend: the Qwen2 text tokenizer and text normalisation / sentence splitting."""
