"""The ``INFIR2_*`` on/off switches read from the environment, parsed by one rule.

``1``, ``true``, ``on``, ``yes`` turn a switch on and ``0``, ``false``, ``off``, ``no`` off (any case, spaces
ignored); unset or empty gives its default. Anything else is refused in one line naming the variable, rather
than read as whichever side a comparison happened to fall on (``INFIR2_FP8_EAGER_QUANT=true`` was ignored,
``INFIR2_RAY_DASHBOARD=yes`` turned the dashboard off). Imports nothing of the package.
"""

from __future__ import annotations

import os

ON = ("1", "true", "on", "yes")
OFF = ("0", "false", "off", "no")


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name``: on or off as its value says, ``default`` when unset or empty."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={raw!r}: use one of {', '.join(ON)} (on) or {', '.join(OFF)} (off)")


def env_flag_set(name: str) -> bool:
    """Whether ``name`` is set to a non-empty value (so the user asked for something explicitly)."""
    return bool(os.environ.get(name, "").strip())
