"""How much of a real gradient's energy each DCT selection keeps: 1-D blocks versus 2-D tiles.

Takes the gradients of the tiny LLaMA (``configs/llama-tiny``) on real C4 windows from the
offline sample (``../shared/data``), at the seeded random init and again after ``--train-steps``
AdamW steps in this one process, and prints, per parameter group, the fraction of the squared
gradient norm (energy) that a selection of 1/4 of the values keeps:

- ``low-pass 1-D``: the lowest quarter of DCT-II frequencies of every 64-value block of the
  flattened gradient (what ``--compression dct --compression-ratio 0.25`` sends);
- ``low-pass 2-D``: the lowest quarter of 2-D DCT frequencies (ordered by ``i + j``, then ``i``)
  of every 8 x 8 tile of the gradient matrix (the 2-D alternative the issue names);
- ``top-k DCT 1-D``: the largest quarter of every 64-value block's DCT coefficients
  (``dct-topk``); ``top-k raw``: the largest quarter of every block's raw values.

A fixed low-pass selection of a signal with no order along the block would keep about 0.25 of
the energy; more means the transform compacts it. The DCT is orthonormal, so energies in the
frequency domain equal energies in the parameter domain (Parseval).

Usage (from the repository root)::

    uv run python benchmarks/dct_energy.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, SHARED_DATA, check_data, markdown_table

from torchrun_ddp.compression import block_layout, dct_basis
from torchrun_ddp.model import build_model, load_model_config
from torchrun_ddp.training_data import PackedWindows, load_tokenizer, open_documents

BLOCK = 64
TILE = 8
FRACTION = 0.25
Selection = Callable[[torch.Tensor], float]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--data-dir", type=Path, default=SHARED_DATA, help="offline C4 sample and tokenizer")
    add("--batch-size", type=int, default=8, help="windows per gradient")
    add("--seq-length", type=int, default=128, help="tokens per window")
    add("--train-steps", type=int, default=50, help="AdamW steps before the second measurement")
    add("--learning-rate", type=float, default=3e-3, help="AdamW learning rate of those steps")
    return parser.parse_args(argv)


def blocks_1d(grad: torch.Tensor) -> torch.Tensor:
    """Flattened gradient, zero-padded, as [n_blocks, BLOCK] (``dct``'s own block layout)."""
    flat = grad.reshape(-1).float()
    return block_layout([0], flat.numel(), BLOCK).to_blocks(flat)


def low_pass_1d(grad: torch.Tensor) -> float:
    """Energy kept by the lowest FRACTION of each block's DCT coefficients, over the total."""
    coeffs = blocks_1d(grad) @ dct_basis(BLOCK).T
    kept = int(BLOCK * FRACTION)
    return float(coeffs[:, :kept].square().sum() / coeffs.square().sum())


def _zigzag_mask() -> torch.Tensor:
    """Boolean [TILE, TILE]: the FRACTION of 2-D frequencies with the smallest i + j (then i)."""
    order = sorted((i + j, i, j) for i in range(TILE) for j in range(TILE))
    mask = torch.zeros(TILE, TILE, dtype=torch.bool)
    for _, i, j in order[: int(TILE * TILE * FRACTION)]:
        mask[i, j] = True
    return mask


def low_pass_2d(grad: torch.Tensor) -> float:
    """Energy kept by the lowest FRACTION of 2-D DCT frequencies of every TILE x TILE tile.

    Only for matrices whose both sides divide by TILE (every matrix of the tiny LLaMA).
    """
    rows, cols = grad.shape
    tiles = grad.float().reshape(rows // TILE, TILE, cols // TILE, TILE).permute(0, 2, 1, 3)
    basis = dct_basis(TILE)
    coeffs = basis @ tiles @ basis.T
    return float(coeffs[..., _zigzag_mask()].square().sum() / coeffs.square().sum())


def top_k(blocks: torch.Tensor) -> float:
    """Energy kept by the FRACTION largest-magnitude values of every row of ``blocks``."""
    kept = int(blocks.shape[1] * FRACTION)
    energy = blocks.square()
    return float(energy.topk(kept, dim=1).values.sum() / energy.sum())


SELECTIONS: dict[str, Selection] = {
    "low-pass 1-D": low_pass_1d,
    "low-pass 2-D": low_pass_2d,
    "top-k DCT 1-D": lambda grad: top_k(blocks_1d(grad) @ dct_basis(BLOCK).T),
    "top-k raw": lambda grad: top_k(blocks_1d(grad)),
}


def group_of(name: str) -> str:
    """Parameter group for the table: embedding, LM head, attention, MLP."""
    for key, group in (("embed", "embedding"), ("lm_head", "LM head"), ("mlp", "MLP")):
        if key in name:
            return group
    return "attention"


def energy_rows(model: torch.nn.Module) -> list[list[str]]:
    """One row per parameter group: each selection's kept energy, weighted by gradient energy."""
    totals: dict[str, dict[str, float]] = {}
    for name, param in model.named_parameters():
        if param.grad is None or param.grad.dim() != 2:
            continue
        group = totals.setdefault(group_of(name), {"energy": 0.0, **dict.fromkeys(SELECTIONS, 0)})
        energy = float(param.grad.float().square().sum())
        group["energy"] += energy
        for label, select in SELECTIONS.items():
            group[label] += energy * select(param.grad)
    return [
        [group, *(f"{values[label] / values['energy']:.3f}" for label in SELECTIONS)]
        for group, values in totals.items()
    ]


def windows(args: argparse.Namespace) -> torch.Tensor:
    """[train_steps + 1, batch_size, seq_length] int64 token ids from the C4 training sample."""
    tokenizer = load_tokenizer(str(args.data_dir / "tokenizer" / "mistral-7b-v0.1"))
    files = [str(path) for path in sorted((args.data_dir / "c4").glob("*train*.json.gz"))]
    stream = PackedWindows(open_documents(files, "", "", "train"), tokenizer, args.seq_length)
    count = (args.train_steps + 1) * args.batch_size
    batch = [window for _, window in zip(range(count), stream, strict=False)]
    return torch.stack(batch).view(args.train_steps + 1, args.batch_size, args.seq_length)


def main(argv: list[str]) -> int:
    """Measure at init and after training; print one table per point."""
    args = parse_args(argv)
    check_data(args.data_dir)
    torch.set_num_threads(2)
    config = load_model_config(str(REPO / "configs" / "llama-tiny" / "config.json"))
    model = build_model("tiny", config, "random", "fp32", 42, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1)
    data = windows(args)
    header = ["parameters", *SELECTIONS]
    for step, batch in enumerate(data):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if step in (0, args.train_steps):
            print(f"\nStep {step} (loss {loss.item():.3f}), energy kept by 1/4 of the values:\n")
            print(markdown_table(header, energy_rows(model)))
        optimizer.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
