"""Training data beyond plain text: conversations with their loss masks."""
