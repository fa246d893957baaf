"""Shared pytest fixtures: paths to the offline data in ../shared/data."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHARED_DATA = Path(os.environ.get("TORCHRUN_DDP_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The offline C4 sample and tokenizer (see ../shared/data/README.md)."""
    if not (SHARED_DATA / "c4").is_dir():
        pytest.fail(f"offline data not found at {SHARED_DATA}; set TORCHRUN_DDP_SHARED_DATA")
    return SHARED_DATA
