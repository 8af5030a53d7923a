"""Filling the stdin of a command that nobody reads: what preflight.transport.base.SEND_STALL_S bounds.

    flood_until_it_fails(cmd.send)  ->  [StdinStalled("the command stopped reading its stdin ...")]
"""
from __future__ import annotations

import threading
from typing import Callable, List


def flood_until_it_fails(send: Callable[[bytes], None], lines: int = 1000, size: int = 65535,
                         wait: float = 60.0) -> List[object]:
    """Send `lines` lines of `size` bytes from a thread of its own. Returns [the OSError that stopped it], or
    ["all sent"], or [] when the sender is still blocked after `wait` seconds (a hang detector far above any stall
    limit a test sets, not a timing assertion)."""
    outcome: List[object] = []

    def flood() -> None:
        try:
            for _ in range(lines):
                send(b"x" * size + b"\n")
            outcome.append("all sent")
        except OSError as exc:
            outcome.append(exc)

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    sender.join(wait)
    return outcome
