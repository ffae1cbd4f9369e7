"""A chart's vertical scale: a round top at or above the peak, and the ticks of its axis,
so a reader can tell a bar's or a line's value from its height."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# The round tops a scale may end at, within each power of ten.
_STEPS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
# Ticks from the top down to 0: top, half, 0. Halves of the round tops stay round.
TICKS = 3


def nice_top(peak: float) -> float:
    """The smallest round value (1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 times a power of ten)
    above `peak` with a little headroom, so the highest point does not touch the frame."""
    if peak <= 0:
        return 1.0
    wanted = peak * 1.05
    power = 10 ** math.floor(math.log10(wanted))
    return next(step * power for step in _STEPS if step * power >= wanted)


def ticks(top: float) -> list[float]:
    """The axis's values from `top` down to 0, evenly spaced."""
    return [top * (TICKS - 1 - i) / (TICKS - 1) for i in range(TICKS)]


def tick_label(value: float) -> str:
    """A tick's number: thousands separated, decimals only as many as the value has (a
    day's cost may be a few millionths)."""
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:,.9f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class Axis:
    """A chart's y axis: the value at its top, and each tick's label and height in the
    chart's units (0 at the top, `height` at the bottom), for the template to draw its grid
    lines and labels."""

    top: float
    ticks: list[tuple[str, float]]

    def y(self, value: float, height: float) -> float:
        """Where `value` lies on a chart `height` tall."""
        return height - height * value / self.top


def axis(peak: float, *, height: float, label: Callable[[float], str] = tick_label) -> Axis:
    """The axis of a chart `height` tall whose highest value is `peak`."""
    top = nice_top(peak)
    return Axis(top=top, ticks=[(label(value), height - height * value / top)
                                for value in ticks(top)])
