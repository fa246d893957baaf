"""Training methods as objects: one module per method and one table (:data:`METHODS`).

Each method (``base.Method``) owns its settings (one validated section of the config), its build
(the DDP comm hook and the optimizer), its state in checkpoints (shared, per rank, sharded) with
the rules for another world size or a lost rank, its identity keys, and its rows in the
``--dry-run`` plan. ``main``, ``build``, ``training_state`` and ``dry_run`` ask the method
and never test which one it is. A new method is one module here and one line in :data:`METHODS`.

Modules: ``base`` (the interface), ``exchanging`` (methods whose optimizer exchanges itself),
``adamw`` (AdamW with the comm-hook family and ZeRO-1), ``demo``, ``local_updates`` (DiLoCo's and
SparseLoCo's shared base) with ``local_update_memory`` (their memory rows), ``diloco``,
``sparseloco``.

Imports: ``config``, ``errors``, the ``distributed`` types, and the components a method is made
of: ``compression``, ``optim``, ``checkpoint`` (its state adapters) and ``plan.communication``
(the link-time calculator). Imported by ``config_checks`` and the composing modules.
"""

from collections.abc import Mapping

from torchrun_ddp.config import TrainConfig
from torchrun_ddp.config_fields import OPTIMIZER_CHOICES, register_choices
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods.adamw import AdamWMethod
from torchrun_ddp.methods.base import (
    CheckpointBytes,
    MemoryRow,
    Method,
    Owners,
    PlanSizes,
    refuse_unused,
)
from torchrun_ddp.methods.demo import DeMoMethod
from torchrun_ddp.methods.diloco import DiLoCoMethod
from torchrun_ddp.methods.muloco import MuLoCoMethod
from torchrun_ddp.methods.sparseloco import SparseLoCoMethod

METHODS: dict[str, type[Method]] = {
    AdamWMethod.name: AdamWMethod,
    DeMoMethod.name: DeMoMethod,
    DiLoCoMethod.name: DiLoCoMethod,
    SparseLoCoMethod.name: SparseLoCoMethod,
    MuLoCoMethod.name: MuLoCoMethod,
}
"""``--optimizer`` value -> its method class."""


def _choice_line(method: type[Method]) -> str:
    """--optimizer's help line of ``method``: its summary, and the modes that refuse it."""
    refused = method.refusing_modes()
    if not refused:
        return method.summary
    return f"{method.summary} (refused under --data-parallel {', '.join(refused)})"


register_choices(
    "optimizer", OPTIMIZER_CHOICES, {name: _choice_line(method) for name, method in METHODS.items()}
)

PRESETS: dict[str, Mapping[str, Mapping[str, object]]] = {
    method.preset_field: method.presets for method in METHODS.values() if method.preset_field
}
"""A preset's config field -> its presets (``Method.presets``), for ``config_io``."""


def method_class(name: str) -> type[Method]:
    """The method class of ``--optimizer name``; raises UserError for an unknown name."""
    method = METHODS.get(name)
    if method is None:
        raise UserError(f"unknown --optimizer {name!r}; use one of {', '.join(METHODS)}")
    return method


def method_for(config: TrainConfig) -> Method:
    """The method ``config`` chooses (--optimizer), with its settings validated; raises
    UserError for an unknown name or settings that do not fit together."""
    return method_class(config.optimizer)(config)


def method_flag_owners() -> Owners:
    """Each method-specific config field (``Method.flags``) -> ``("optimizer", the methods
    that read it)``, in :data:`METHODS` order."""
    owners: dict[str, list[str]] = {}
    for name, method in METHODS.items():
        for flag in method.flags:
            owners.setdefault(flag, []).append(name)
    return {flag: ("optimizer", tuple(names)) for flag, names in owners.items()}


def check_methods(config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
    """Every method's flag checks: each method's ``Method.check_config`` (ranges whatever
    --optimizer is, and the chosen method's combinations), then a method-specific flag
    ``given`` (on the command line or in the config file) under an --optimizer that does not
    read it. Raises UserError, one line naming the flag."""
    for method in METHODS.values():
        method.check_config(config, given)
    refuse_unused(config, given, method_flag_owners())


def check_sites_method(config: TrainConfig) -> None:
    """Under --fault-tolerance sites: the method's own answer whether it exchanges across sites
    (``Method.site_problem``). Raises UserError, one line naming the fix."""
    if config.fault_tolerance != "sites":
        return
    if problem := METHODS[config.optimizer].site_problem(config):
        raise UserError(f"--fault-tolerance sites: {problem}")


__all__ = [
    "METHODS",
    "PRESETS",
    "AdamWMethod",
    "CheckpointBytes",
    "DeMoMethod",
    "DiLoCoMethod",
    "MemoryRow",
    "Method",
    "Owners",
    "PlanSizes",
    "SparseLoCoMethod",
    "check_methods",
    "check_sites_method",
    "method_class",
    "method_flag_owners",
    "method_for",
    "refuse_unused",
]
