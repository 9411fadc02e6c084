"""raylign: post-training for Hugging Face language models."""

__version__ = "0.1.0"
