"""Integrations of kubetrain with training libraries: `kubetrain.integrations.hf` (Hugging Face Trainer)."""
