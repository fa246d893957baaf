"""SparseLoCo as its authors run it, and eager updates (optim/sparseloco_codec.py,
optim/local_updates.py, the --sparseloco-preset of config_io): Templar's statistical quantizer,
the mean over senders, median norm clipping, the preset's precedence, and eager updates' outer
step on an estimate (Kale et al. 2025) with exact resume inside the delay, on 2 gloo ranks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from distributed_harness import run_distributed
from local_update_helpers import LocalUpdates, describe, local_update_settings
from test_local_update_overlap import SAVE_AT, STEPS, H, _resume_in_the_delay
from tiny_models import random_gradients, random_parameters

from torchrun_ddp.compression.wire import sparseloco_chunk_payload, sparseloco_payload_bytes
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.errors import UserError
from torchrun_ddp.optim import LocalUpdateSettings
from torchrun_ddp.optim.sparseloco_codec import (
    MessageFormat,
    chunk_codec,
    decode_mean,
    encode_chunks,
    quantize_statistical,
)

SPARSE = ["--optimizer", "sparseloco", "--compression", "none"]


def test_the_statistical_quantizer_is_templars_per_tensor_codebook() -> None:
    """2 bits: bins 1.5 std wide around the mean, bin 2 holding the values within half a bin of
    it (Templar's asymmetric offset); each level is the mean of its values; 8 bits come back
    within a bin."""
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(16, 8, generator=generator)
    codes, table = quantize_statistical(values, 2)
    centred = values - values.mean()
    width = 6.0 * centred.norm() / math.sqrt(values.numel() - 1) / 4
    assert torch.equal(codes, (centred / width + 2).round().clamp(0, 3).long())
    assert float(table[0]) == pytest.approx(float(values.mean()))
    for level in range(4):
        inside = centred[codes == level]
        want = float(inside.mean()) if inside.numel() else 0.0
        assert float(table[1 + level]) == pytest.approx(want, abs=1e-6)
    fine_codes, fine = quantize_statistical(values, 8)
    back = fine[1:][fine_codes] + fine[0]
    assert float((back - values).abs().max()) < 6.0 * float(centred.std()) / 256


def test_messages_have_the_wire_size_and_decode_over_senders_with_median_clipping() -> None:
    """Three ranks send one 4 x 4 parameter (chunk 4, k 2, fp32 values): over senders a value
    sent by one rank is that value (over all ranks a third of it); median clipping scales the
    rank with the largest message down to the median norm."""
    codec = chunk_codec((4, 4), 4, 2)
    chunks = [torch.zeros(1, 16) for _ in range(3)]
    chunks[0][0, [0, 1]] = torch.tensor([3.0, 4.0])  # norm 5
    chunks[1][0, [0, 2]] = torch.tensor([6.0, 8.0])  # norm 10
    chunks[2][0, [3, 4]] = torch.tensor([30.0, 40.0])  # norm 50
    for form in (MessageFormat(0), MessageFormat(2, "statistical"), MessageFormat(8)):
        message, _ = encode_chunks(chunks[0], codec, form)
        size = sparseloco_chunk_payload(1, 2, 16, form.bits, form.quantizer)
        formula = sparseloco_payload_bytes([(4, 4)], 2, 4, form.bits, form.quantizer)
        assert message.numel() == size == formula
    rows = torch.stack([encode_chunks(c, codec, MessageFormat(0))[0] for c in chunks])
    everyone = decode_mean(rows, codec, MessageFormat(0)).reshape(-1)
    senders = decode_mean(rows, codec, MessageFormat(0, aggregate="senders")).reshape(-1)
    clipped = decode_mean(rows, codec, MessageFormat(0, aggregate="senders", clip="median"))
    assert everyone[:5].tolist() == pytest.approx([3.0, 4 / 3, 8 / 3, 10.0, 40 / 3])
    assert senders[:5].tolist() == pytest.approx([4.5, 4.0, 8.0, 30.0, 40.0])
    assert clipped.reshape(-1)[:5].tolist() == pytest.approx([4.5, 4.0, 8.0, 6.0, 8.0])


def test_the_templar_preset_fills_what_neither_a_flag_nor_the_file_sets(tmp_path: Path) -> None:
    preset = parse_config([*SPARSE, "--sparseloco-preset", "templar"])
    settings = local_update_settings(preset)
    assert describe(settings) == (
        "sparseloco H=30 k=64/4096 2-bit statistical beta 0.95 lr 1 senders median"
    )
    flag = parse_config([*SPARSE, "--sparseloco-preset", "templar", "--local-steps", "25"])
    assert (flag.local_steps, flag.sparseloco_quantizer) == (25, "statistical")
    file = tmp_path / "run.toml"
    file.write_text('sparseloco_preset = "templar"\nsparseloco_beta = 0.999\n')
    from_file = parse_config([*SPARSE, "--config", str(file)])
    assert (from_file.sparseloco_beta, from_file.local_steps) == (0.999, 30)
    with pytest.raises(UserError, match=r"^--sparseloco-preset templar sets SparseLoCo's"):
        parse_config(["--sparseloco-preset", "templar"])
    with pytest.raises(UserError, match=r"^--eager-updates changes an overlapped"):
        parse_config([*SPARSE, "--eager-updates"])
    with pytest.raises(UserError, match=r"^--eager-updates works with --compression-scope glo"):
        parse_config([*SPARSE, "--overlap-exchange", "--eager-updates",
                      "--compression-scope", "inter-node"])  # fmt: skip


SHAPES = [(24, 40), (130,), (7,)]


def _eager_steps(rank: int, settings: LocalUpdateSettings) -> dict[str, float]:
    """Runs 3 windows; at every step that starts a sync, checks the local parameters against
    ``synced - lr (est + m (m buf + est))`` with ``est = last_mean + (own - last_own) / W``
    (``own``: this rank's part, kept as ``last_own`` by the step; ``last_mean`` and the outer
    momentum ``buf`` as the step leaves them: a sync landing in the same step updates them
    first). Returns the largest gap, and the largest gap between the ranks' synced copies."""
    params = random_parameters(SHAPES, 0)
    inner = torch.optim.AdamW(params, lr=0.05, weight_decay=0.0)
    wrapped = LocalUpdates(inner, settings)
    momentum, lr = settings.outer_momentum, settings.outer_lr
    gap = 0.0
    for step in range(1, STEPS + 1):
        for param, grad in zip(params, random_gradients(SHAPES, step, rank), strict=True):
            param.grad = grad
        last_own = [t.clone() for t in wrapped.last_own]
        wrapped.step()
        if step % H:
            continue
        for index, (param, copy) in enumerate(zip(params, wrapped.synced, strict=True)):
            est = wrapped.last_mean[index] + (wrapped.last_own[index] - last_own[index]) / 2
            if momentum:
                buffer = wrapped.outer.state[copy]["momentum_buffer"]
                est = est + momentum * (momentum * buffer + est)
            gap = max(gap, float((param.detach() - (copy - lr * est)).abs().max()))
    synced = torch.cat([c.reshape(-1) for c in wrapped.synced])
    both = [torch.zeros_like(synced) for _ in range(2)]
    torch.distributed.all_gather(both, synced)
    return {"gap": gap, "ranks": float((both[0] - both[1]).abs().max())}


EAGER_DILOCO = LocalUpdateSettings("diloco", H, 0.7, 0.9, sync_delay=2, eager=True)
EAGER_SPARSE = LocalUpdateSettings(
    "sparseloco", H, 1.0, 0.0, topk=4, chunk=8, sync_delay=H, eager=True,
    quantizer="statistical", aggregate="senders", clip="median",
)  # fmt: skip


def _worker(rank: int, world: int, root: str) -> dict[str, object]:
    return {
        "diloco": _eager_steps(rank, EAGER_DILOCO),
        "sparse": _eager_steps(rank, EAGER_SPARSE),
        "resume_diloco": _resume_in_the_delay(rank, root, EAGER_DILOCO, SAVE_AT),
        "resume_sparse": _resume_in_the_delay(rank, root, EAGER_SPARSE, H),
    }


@pytest.mark.slow  # one spawn of 2 ranks, several windows and two resumes
def test_eager_updates_step_on_the_estimate_and_resume_exactly_inside_the_delay(
    tmp_path: Path,
) -> None:
    ranks = run_distributed(_worker, 2, str(tmp_path), timeout=240.0)
    for result in ranks:
        for method in ("diloco", "sparse"):
            assert result[method]["gap"] < 1e-6, (method, result[method])
            assert result[method]["ranks"] == 0.0  # the synced copies stay bit-identical
        for method in ("resume_diloco", "resume_sparse"):
            run = result[method]
            assert torch.equal(run["final"], run["resumed"]), method
    assert ranks[0]["resume_sparse"]["in_flight_at_save"]
