"""Test helpers: tiny random-weight models for exercising the tracer without downloads."""

from kvcouple.testing.tiny_models import TINY_ARCHS, tiny_model

__all__ = ["TINY_ARCHS", "tiny_model"]
