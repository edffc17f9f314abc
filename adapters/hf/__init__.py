"""The Hugging Face transformers adapter."""
