"""Cost of checksums at rest (issue 43): seconds per checkpoint that the manifest adds when a
step is saved, and that verifying a step costs when a run resumes, per model.

Prints one Markdown table (from the repository root)::

    uv run python benchmarks/manifest_cost.py

Per model (the quick start's ``configs/llama-tiny``, 19.5M parameters, and
``configs/llama-8m``), with AdamW state after one step, saved by ``save_checkpoint`` in one
process (one DCP shard, one rank's files): the checkpoint's size; the whole save's seconds;
the part of it that hashes DCP's shard after writing (``manifest.dcp_share``: the rank files,
``shared.json`` and ``meta.json`` are hashed while they are written, which is not separable);
``verify_step`` at resume with ``full`` (every file read and hashed) and ``size`` (sizes
only). Medians of ``--repeats``; wall clock on whatever else the machine is doing, with a warm
page cache (a cold read from disk adds the disk's read time to ``full``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import markdown_table
from transformers import AutoConfig, AutoModelForCausalLM

from torchrun_ddp.checkpoint import ModelAndOptimizer, save_checkpoint, verify_step
from torchrun_ddp.checkpoint.manifest import dcp_share

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "quick start (configs/tiny.toml: llama-tiny)": REPO / "configs" / "llama-tiny" / "config.json",
    "llama-8m (configs/llama-8m/config.json)": REPO / "configs" / "llama-8m" / "config.json",
}


def _trained(config_path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model at random init and AdamW after one step (its moments exist)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def _measure(config_path: Path, repeats: int) -> list[str]:
    """One table row: parameters, MiB, save s, DCP hashing s, verify full s, verify size s."""
    model, optimizer = _trained(config_path)
    state = {"train": ModelAndOptimizer(model, optimizer)}
    saves, hashes, fulls, sizes = [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for step in range(1, repeats + 1):
            began = time.perf_counter()
            path = save_checkpoint(root, step, state, {"x": 1}, {}, keep=1)
            saves.append(time.perf_counter() - began)
            began = time.perf_counter()
            dcp_share(path / "dcp", 0, 1)
            hashes.append(time.perf_counter() - began)
            began = time.perf_counter()
            assert verify_step(path, "full") == ""
            fulls.append(time.perf_counter() - began)
            began = time.perf_counter()
            assert verify_step(path, "size") == ""
            sizes.append(time.perf_counter() - began)
        mib = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
    params = sum(p.numel() for p in model.parameters()) / 1e6
    median = statistics.median
    return [
        f"{params:.1f}M", f"{mib:.0f}", f"{median(saves):.2f}", f"{median(hashes):.3f}",
        f"{median(fulls):.3f}", f"{median(sizes):.4f}",
    ]  # fmt: skip


def main() -> None:
    """Measure every model and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="saves per model (median)")
    args = parser.parse_args()
    header = [
        "model", "parameters", "checkpoint MiB", "save s", "hash DCP shard at save s",
        "verify full s", "verify size s",
    ]  # fmt: skip
    rows = [[name, *_measure(path, args.repeats)] for name, path in MODELS.items()]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
