"""torchrun-ddp."""
