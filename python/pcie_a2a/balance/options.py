"""How to balance (:class:`Options`): shared by the steps of :mod:`.algorithm` and
:mod:`.refine`, so neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost import KIMI_K2, GemmCost, RowBytes


def _default_cost() -> GemmCost:
    return GemmCost.roofline()


@dataclass(frozen=True)
class Options:
    """How to balance. ``redundant`` extra replicas in all (``W * slots_per_rank - E``)."""

    redundant: int = 0
    tokens_per_step: int = 128  # tokens per rank per step: turns window counts into rows
    top_k: int = 8
    cost: GemmCost = field(default_factory=_default_cost)
    row_bytes: RowBytes = field(default_factory=RowBytes.for_model)
    expert_bytes: int = KIMI_K2.weight_bytes
    move_gbps: float = 25.0  # what moving weights gets over PCIe
    steps_between_rebalances: int = 1000
    count_slack: float = 0.0  # phase 2 may raise the largest token count by this fraction
    keep_margin: float = 0.002  # a new placement must beat the current one by this fraction
    max_swaps: int = 4000

    def __post_init__(self) -> None:
        for name in ("redundant",):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: got {v!r}; allowed: an int >= 0")
        for name in ("tokens_per_step", "top_k", "steps_between_rebalances"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: got {v!r}; allowed: an int >= 1")
        if not self.move_gbps > 0:
            raise ValueError(f"move_gbps: got {self.move_gbps!r}; allowed: > 0")

    @property
    def move_us(self) -> float:
        """Per-step worth of not moving one expert."""
        return self.expert_bytes / (self.move_gbps * 1e3) / self.steps_between_rebalances
