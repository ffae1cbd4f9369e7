"""What a content rule says about a line it refuses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

VIOLATION = "content_policy_violation"


@dataclass(frozen=True)
class Violation:
    rule: str
    action: str  # "reject" or "skip"
    reason: str

    @classmethod
    def of(cls, rule: Any) -> Violation:
        """The violation of a ContentRule."""
        return cls(rule=rule.name, action=rule.action, reason=rule.reason)

    @property
    def message(self) -> str:
        return f"Refused by content rule '{self.rule}'" + (f": {self.reason}" if self.reason
                                                            else ".")


# (line number, custom_id, violation)
ViolationSink = Callable[[int, str, Violation], None]
