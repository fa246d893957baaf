"""The causal LM, one idea per module: ``causal_lm`` (config, weights, ``ModelSpec``, how it
runs: activation checkpointing, compile, autocast), ``lora`` (peft adapters and the final
export), ``fused_loss`` (Liger's fused linear cross-entropy), ``batches`` (a micro-batch's
inputs). Wrapping it for data parallelism is ``parallel``'s.

Imports: ``errors`` only (a component).
"""

from torchrun_ddp.model.batches import IGNORED_LABEL, causal_lm_inputs, trained_tokens
from torchrun_ddp.model.causal_lm import (
    GATED_ORGS,
    PEFT_METHODS,
    PRECISION_DTYPES,
    ModelSpec,
    autocast_context,
    build_model,
    check_access,
    compile_blocks,
    compile_failure,
    compile_model,
    enable_activation_checkpointing,
    hidden_matrices,
    load_model_config,
    max_positions,
    trainable_parameter_sizes,
    weight_dtype,
)
from torchrun_ddp.model.fused_loss import (
    FUSED_LOSS_AUTO_TYPES,
    FUSED_LOSS_KERNELS_OFF,
    apply_fused_loss,
    check_fused_loss,
    liger_installed,
    liger_model_types,
    uses_fused_loss,
)
from torchrun_ddp.model.lora import (
    LoraSettings,
    apply_lora,
    export_final_model,
    lora_settings,
    save_lora_outputs,
)

__all__ = [
    "FUSED_LOSS_AUTO_TYPES",
    "FUSED_LOSS_KERNELS_OFF",
    "GATED_ORGS",
    "IGNORED_LABEL",
    "PEFT_METHODS",
    "PRECISION_DTYPES",
    "LoraSettings",
    "ModelSpec",
    "apply_fused_loss",
    "apply_lora",
    "autocast_context",
    "build_model",
    "causal_lm_inputs",
    "check_access",
    "check_fused_loss",
    "compile_blocks",
    "compile_failure",
    "compile_model",
    "enable_activation_checkpointing",
    "export_final_model",
    "hidden_matrices",
    "liger_installed",
    "liger_model_types",
    "load_model_config",
    "lora_settings",
    "max_positions",
    "save_lora_outputs",
    "trainable_parameter_sizes",
    "trained_tokens",
    "uses_fused_loss",
    "weight_dtype",
]
