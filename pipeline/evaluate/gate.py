"""The promotion gate: does the challenger replace the champion?"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.evaluate.metrics import HIGHER_IS_BETTER


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def decide(metric: str, challenger: dict[str, float], champion: dict[str, float] | None, tolerance: float) -> Decision:
    """Promote when there is no champion, or the challenger is not worse by more than ``tolerance``."""
    if champion is None:
        return Decision(True, f"no champion yet; challenger {metric}={challenger[metric]:.4f}")
    new, old = challenger[metric], champion[metric]
    # Positive when the challenger is worse, in the metric's own units.
    shortfall = (old - new) if HIGHER_IS_BETTER[metric] else (new - old)
    comparison = f"challenger {metric}={new:.4f} vs champion {old:.4f}, tolerance {tolerance}"
    if shortfall <= tolerance:
        return Decision(True, f"{comparison}: not worse beyond tolerance")
    return Decision(False, f"{comparison}: worse by {shortfall:.4f}")
