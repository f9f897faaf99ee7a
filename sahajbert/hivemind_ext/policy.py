"""The project's policies that the fence's mechanisms apply, as `install()` was given them.

The fence decides how hivemind is bounded and checked; the project decides by which rules (which aggregation rule,
how far a returned average may be from this peer's values, which training states and progress claims are taken) and
within which limits (how long a DHT record may be kept). They are set once, by `install()`, in the process a peer
starts; the DHT and averager processes it forks inherit them.
"""

from typing import Any

_GIVEN: dict[str, Any] = {}


class NotInstalled(RuntimeError):
    """The fence was used before `sahajbert.hivemind_ext.install()` gave it the project's policies."""


def give(**policies) -> None:
    _GIVEN.update(policies)


def _given(name: str):
    try:
        return _GIVEN[name]
    except KeyError:
        raise NotInstalled(f"sahajbert.hivemind_ext.install() was not called: no {name} was given") from None


def rules():
    """The robust rules (`sahajbert.robust`): `Aggregation`, `aggregate`, `finite`, `implausible`, `PAIR_FACTOR`,
    `PARAMETER_PAIR_FACTOR`, `StateTemplate`, `flat_keys`, `step_out_of_range`, `state_cut_short`, `state_problem`,
    `plausible_progress`, `Standing` and `UNBACKED`."""
    return _given("rules")


def max_record_lifetime() -> float:
    """Seconds: the longest this peer keeps a DHT record that another peer stores (`BoundedLocalStorage`)."""
    return _given("max_record_lifetime")
