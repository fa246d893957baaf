"""The benchmark variants (benchmarks/common.py) are train.py settings: each variant's flags parse
into a valid TrainConfig, so a misspelt flag fails here, not when a benchmark command reaches
that variant after the runs before it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torchrun_ddp.config_io import parse_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import Variant, all_variants, optimizer_of

VARIANTS = all_variants()


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=list(VARIANTS))
def test_every_variant_is_a_valid_train_config(variant: Variant) -> None:
    config = parse_config(list(variant.flags))
    assert config.optimizer == optimizer_of(variant)


def test_the_lever_variants_change_only_their_own_setting() -> None:
    base = parse_config(list(VARIANTS["sparseloco-h25"].flags))
    outer = parse_config(list(VARIANTS["sparseloco-h25-outer1.5"].flags))
    decay = parse_config(list(VARIANTS["sparseloco-h25-beta0.999"].flags))
    wide = parse_config(list(VARIANTS["sparseloco-h100-k256"].flags))
    assert (base.local_steps, base.sparseloco_topk, base.outer_lr) == (25, 64, 0.0)
    assert (outer.outer_lr, outer.sparseloco_beta) == (1.5, base.sparseloco_beta)
    assert (decay.sparseloco_beta, decay.outer_lr) == (0.999, base.outer_lr)
    assert (wide.local_steps, wide.sparseloco_topk) == (100, 256)
