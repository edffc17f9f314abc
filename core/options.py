"""An adapter's options, typed: what ``weightcache_options`` declares and how a value is checked where it enters.

An adapter declares each option as an :class:`AdapterOption` (a help text alone
still works, untyped). The core checks every value a load asks for before
anything is read (``Adapter.check_options``), and the conformance kit flips each
option to its other values on a published entry: either the fingerprint changes,
or a client asking for the other value gets exactly its own disk load.
"""

from __future__ import annotations

import json
import typing

import attrs

TYPES: typing.Final = (bool, int, float, str, list, dict)
"""The types an option may declare: what a JSON value (``--option KEY=VALUE``) decodes to."""


def _values(value: typing.Iterable) -> tuple:
    return tuple(value)


def _option_type(_instance, _attribute, value) -> None:
    if value is not None and value not in TYPES:
        raise ValueError(f"an option's type must be one of {', '.join(t.__name__ for t in TYPES)} (JSON values), not {value!r}")


@attrs.frozen
class AdapterOption:
    """One option an adapter reads from ``LoadRequest.options``.

    :param help: one line saying what the option does and its default.
    :param type: the JSON type of its values (bool, int, float, str, list or dict); None: untyped.
    :param choices: the only values allowed (an enum), if any.
    :param default: the value the adapter uses when the option is not given.
    :param alternatives: values the conformance kit tries besides the one a load uses;
        default: derived (the other boolean, the other choices).
    """

    help: str
    type: type | None = attrs.field(default=None, validator=_option_type)
    choices: tuple = attrs.field(default=(), converter=_values)
    default: typing.Any = None
    alternatives: tuple = attrs.field(default=(), converter=_values)

    @classmethod
    def of(cls, declared: "AdapterOption | str") -> "AdapterOption":
        """The option from what an adapter declared: an AdapterOption, or a help text alone (untyped)."""
        if isinstance(declared, cls):
            return declared
        if isinstance(declared, str):
            return cls(help=declared)
        raise TypeError(f"an option is declared as AdapterOption(help, type=...) or a help text, not {type(declared).__name__}")

    @property
    def typed(self) -> bool:
        """Whether the kit can flip it: a type or choices, and values to flip to."""
        return bool(self.candidates())

    def problem(self, value: typing.Any) -> str | None:
        """Why ``value`` is not a value of this option, or None if it is."""
        if self.choices and value not in self.choices:
            return f"expected one of {', '.join(map(repr, self.choices))}"
        if self.type is None or value is None:
            return None
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            return None
        if self.type is list and isinstance(value, tuple):
            return None
        if not isinstance(value, self.type) or (self.type is int and isinstance(value, bool)):
            return f"expected a {self.type.__name__}, got {type(value).__name__} {value!r}"
        return None

    def candidates(self) -> tuple:
        """Every value the kit may try: the declared alternatives, else both booleans or the choices."""
        if self.alternatives:
            return self.alternatives
        if self.choices:
            return self.choices
        if self.type is bool:
            return (False, True)
        return ()

    def flips(self, current: typing.Any) -> tuple:
        """The values to try instead of ``current`` (the load's value, or the default when it sets none)."""
        current = self.default if current is None else current
        return tuple(value for value in self.candidates() if value != current)


def declared_options(declared: "typing.Mapping[str, AdapterOption | str]") -> dict[str, AdapterOption]:
    """``weightcache_options``' result as AdapterOptions by name (TypeError for anything else)."""
    if not isinstance(declared, typing.Mapping):
        raise TypeError(f"returned a {type(declared).__name__}, not a mapping of option name to AdapterOption or help text")
    options = {}
    for name, value in declared.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"returned an option named {name!r}; names are non-empty strings")
        try:
            options[name] = AdapterOption.of(value)
        except TypeError as exc:
            raise TypeError(f"option {name!r}: {exc}") from None
    return options


def parse_options(pairs: list[str]) -> dict:
    """``KEY=VALUE`` strings as a dict; a VALUE that is JSON is decoded, else kept as a string."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {pair!r} is not KEY=VALUE; write it like --option model_class=AutoModel")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options
