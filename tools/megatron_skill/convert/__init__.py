"""Checkpoints in and out: Hugging Face weights to Megatron-Core's GPTModel and back."""
