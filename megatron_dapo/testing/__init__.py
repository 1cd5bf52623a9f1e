"""Helpers that build small local artefacts (tokenizers, models) for tests and the CPU demo."""
