"""Training data as the tools meet it: indexed datasets and their records (datasets.py), and
conversations with their loss masks (chat.py)."""
