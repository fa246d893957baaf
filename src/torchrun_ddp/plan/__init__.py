"""The plan before a run (``--dry-run``), and the sizes and FLOPs the run reports: what a
configuration costs per rank in memory, FLOPs and wire bytes, without a GPU or a download.

Modules: ``architecture`` (decoder sizes of any causal LM config, the meta-device model,
parameter counts, training FLOPs per token, LLaMA-2-7B's config), ``memory`` (the per-rank
memory and FLOP plan, full fine-tuning and LoRA), ``fit`` (setting changes that make a plan
fit, plans side by side), ``communication`` (every method's wire bytes, link time and state
memory: DDP's comm hooks, DeMo, DiLoCo, SparseLoCo; the bandwidth model). These calculators are
what ``methods`` builds its plan rows on; the ``--dry-run`` report that composes them with the
training method is ``torchrun_ddp.dry_run``.

Imports: ``config``, ``distributed`` (its environment type), ``errors``, ``model`` (loading a
model's config, LoRA on the meta model, precision dtypes), and the settings and cost model of
``compression``. It runs no collective and touches no device.
"""

from torchrun_ddp.plan.architecture import (
    matmul_parameter_count,
    meta_model,
    model_flops_per_token,
    parameter_count,
)

__all__ = [
    "matmul_parameter_count",
    "meta_model",
    "model_flops_per_token",
    "parameter_count",
]
