"""The local-update optimizers and their plan rows by method name, for the tests that build them
from ``LocalUpdateSettings`` alone: the method classes (``methods.METHODS``) own which optimizer
runs a method, its description and its memory rows; these look the class up by
``settings.method`` and ask it, as the tests were written to call the optimizer directly."""

from __future__ import annotations

from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from torchrun_ddp.compression import CompressionState
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.methods import MemoryRow, method_class
from torchrun_ddp.methods.local_updates import LocalUpdatesMethod
from torchrun_ddp.optim import LocalUpdates as LocalUpdatesBase
from torchrun_ddp.optim import LocalUpdateSettings


def _method(name: str) -> type[LocalUpdatesMethod]:
    method = method_class(name)
    assert issubclass(method, LocalUpdatesMethod), name
    return method


class _ByMethod(type):
    """``LocalUpdates(inner, settings, ...)`` builds the optimizer of ``settings.method``
    (``LocalUpdatesMethod.optimizer_class``), and ``isinstance(x, LocalUpdates)`` asks the
    optimizers' base class."""

    def __call__(
        cls, inner: Optimizer, settings: LocalUpdateSettings, *args: object, **kwargs: object
    ) -> LocalUpdatesBase:
        optimizer = _method(settings.method).optimizer_class
        return optimizer(inner, settings, *args, **kwargs)  # type: ignore[arg-type]

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, LocalUpdatesBase)


class LocalUpdates(metaclass=_ByMethod):
    """The local-update optimizer of a ``LocalUpdateSettings``' method (see ``_ByMethod``)."""


def build_local_updates(
    inner: Optimizer,
    settings: LocalUpdateSettings,
    state: CompressionState,
    process_group: ProcessGroup | None = None,
) -> LocalUpdatesBase:
    """As ``LocalUpdatesMethod.build_optimizer`` builds it around ``inner``: syncing in
    ``process_group`` (default ``state``'s), counting its bytes in ``state``."""
    group = process_group or state.process_group
    optimizer = _method(settings.method).optimizer_class
    return optimizer(inner, settings, group, state.count, state.node_groups)


def memory_rows(
    settings: LocalUpdateSettings,
    shapes: list[tuple[int, ...]],
    world_size: int,
    param_bytes: int = 4,
) -> list[MemoryRow]:
    """``LocalUpdatesMethod.rows`` of ``settings.method``."""
    return _method(settings.method).rows(settings, shapes, world_size, param_bytes)


def describe(settings: LocalUpdateSettings) -> str:
    """``LocalUpdatesMethod.describe_settings`` of ``settings.method``."""
    return _method(settings.method).describe_settings(settings)


def local_update_settings(config: TrainConfig) -> LocalUpdateSettings:
    """``LocalUpdatesMethod.settings_of`` of ``--optimizer``."""
    return _method(config.optimizer).settings_of(config)
