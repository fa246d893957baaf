"""Shared pytest fixtures: the C4 sample and tokenizer bundled in the repository's data/."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

SAMPLE_DATA = REPO / "data"


@pytest.fixture(scope="session")
def sample_data() -> Path:
    """The bundled offline data (``data/README.md``): ``c4/*train*.json.gz``,
    ``c4/*validation*.json.gz`` and ``tokenizer/mistral-7b-v0.1``."""
    if not (SAMPLE_DATA / "c4").is_dir():
        pytest.fail(f"bundled data not found at {SAMPLE_DATA}; is this a complete checkout?")
    return SAMPLE_DATA
