import pytest

from recipes.testing import make_audio_files


@pytest.fixture(scope="session")
def audio_files(tmp_path_factory):
    """16 kHz mono FLACs of 10 s, 3.5 s and 0.7 s (shorter than a 4 s window)."""
    return make_audio_files(
        tmp_path_factory.mktemp("audio"), seconds=[10.0, 3.5, 0.7], sample_rate=16000, seed=4
    )
