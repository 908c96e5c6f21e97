"""Shared fixtures and hypothesis profiles."""

import os

from hypothesis import HealthCheck, settings

# CI runs a fixed, moderate number of examples; locally `HYPOTHESIS_PROFILE=thorough` digs deeper.
settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
