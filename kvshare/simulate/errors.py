"""The one error the simulator raises for bad input.

The CLI prints its message as a single line and exits with status 2, so every message
names the offending value and says what to change.
"""

from __future__ import annotations


class SimulateInputError(ValueError):
    """A trace, flag or list the user gave cannot be used; the message says how to fix it."""
