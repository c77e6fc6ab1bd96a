"""The promotion gate: a primary metric that must improve enough, guardrails that must not regress."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pipeline.config import EvaluateConfig


@dataclass(frozen=True)
class Decision:
    passed: bool
    reason: str
    primary: dict = field(default_factory=dict)
    guardrails: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "passed" if self.passed else "failed"

    def tags(self) -> dict[str, str]:
        """Model-version tags that record the decision, the numbers and why."""
        tags = {"validation_status": self.status, "validation.reason": self.reason}
        if self.primary:
            tags |= {f"validation.primary.{k}": str(v) for k, v in self.primary.items()}
        if self.guardrails:
            tags["validation.guardrails"] = json.dumps(self.guardrails)
        return tags

    def to_dict(self) -> dict:
        return asdict(self) | {"status": self.status}


def gain(higher_is_better: bool, challenger: float, champion: float) -> float:
    """How much better the challenger is, in the metric's units (negative when worse)."""
    return challenger - champion if higher_is_better else champion - challenger


def not_comparable(reason: str) -> Decision:
    """The champion cannot be scored on the challenger's data (another input schema): the gate fails."""
    return Decision(False, f"champion not comparable: {reason}")


def decide(cfg: EvaluateConfig, challenger: dict[str, float], champion: dict[str, float] | None,
           directions: dict[str, bool]) -> Decision:
    """Pass when there is no champion, or the primary metric gains at least ``min_improvement`` and
    no guardrail metric loses more than ``guardrail_tolerance``. ``directions``: metric -> higher is better."""
    metric = cfg.metric
    if champion is None:
        return Decision(True, f"no champion yet; challenger {metric}={challenger[metric]:.4f}",
                        {"metric": metric, "challenger": round(challenger[metric], 6)})
    improvement = gain(directions[metric], challenger[metric], champion[metric])
    primary = {"metric": metric, "challenger": round(challenger[metric], 6), "champion": round(champion[metric], 6),
               "improvement": round(improvement, 6), "min_improvement": cfg.min_improvement}
    reasons = []
    ok = improvement >= cfg.min_improvement
    reasons.append(
        f"{metric} {challenger[metric]:.4f} vs champion {champion[metric]:.4f}: gain {improvement:+.4f} "
        f"{'>=' if ok else '<'} required {cfg.min_improvement:+.4f}"
    )
    guardrails = []
    for name in cfg.guardrails:
        regression = -gain(directions[name], challenger[name], champion[name])
        held = regression <= cfg.guardrail_tolerance
        guardrails.append({"metric": name, "challenger": round(challenger[name], 6), "champion": round(champion[name], 6),
                           "regression": round(regression, 6), "tolerance": cfg.guardrail_tolerance, "held": held})
        if not held:
            reasons.append(f"guardrail {name} regressed by {regression:.4f} > tolerance {cfg.guardrail_tolerance}")
        ok = ok and held
    return Decision(ok, "; ".join(reasons), primary, guardrails)
