"""The human step before ``promote``: Airflow's human-in-the-loop operator, asked only when the run's
``require_approval`` Param is set and the gate passed."""

from __future__ import annotations

from typing import Any

from pipeline.results import Approval, Evaluation


def promotion_approval(*, task_id: str = "approve", evaluate_task_id: str = "evaluate", **kwargs: Any):
    """A human-in-the-loop step before ``promote``; it asks only when the run's
    ``require_approval`` Param is set and the gate passed, and otherwise answers itself."""
    from datetime import timedelta

    from airflow.providers.standard.operators.hitl import HITLOperator

    class PromotionApproval(HITLOperator):
        """Its XCom is an ``Approval``: its own answer, or the person's (``execute_complete``)."""

        def execute(self, context):
            if not context["params"].get("require_approval"):
                return Approval(chosen_options=("Approve",), responded_by_user="not required").to_xcom()
            evaluation = Evaluation.from_xcom(context["ti"].xcom_pull(task_ids=evaluate_task_id))
            gate, challenger = evaluation.gate, evaluation.challenger
            if not gate.passed:
                return Approval(chosen_options=("Reject",), responded_by_user="gate failed").to_xcom()
            self.body = (
                f"Challenger version {challenger.version} passed the gate: {gate.reason}.\n\n"
                f"Test metrics: " + ", ".join(f"{k} {v:.4f}" for k, v in challenger.metrics.items())
                + f"\n\nReport: {evaluation.report}"
            )
            return super().execute(context)

        def execute_complete(self, context, event):
            answer = super().execute_complete(context, event)
            who = answer.get("responded_by_user")  # {"id", "name"}; none when the timeout chose the defaults
            if isinstance(who, dict):
                who = who.get("name") or who.get("id")
            responded_at = answer.get("responded_at")
            return Approval(chosen_options=tuple(answer.get("chosen_options") or ("Reject",)),
                            responded_by_user=str(who or "nobody (timed out)"),
                            responded_at=getattr(responded_at, "isoformat", lambda: responded_at)()).to_xcom()

    return PromotionApproval(
        task_id=task_id,
        subject="Promote the challenger to champion?",
        options=["Approve", "Reject"],
        defaults=["Reject"],
        multiple=False,
        response_timeout=timedelta(hours=24),
        **kwargs,
    )
