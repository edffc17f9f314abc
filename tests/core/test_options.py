"""Typed adapter options: the values a declaration allows, and the values the kit flips to."""

from __future__ import annotations

import pytest

from weightcache.core.options import AdapterOption, declared_options


def test_a_value_is_checked_against_its_type_and_choices():
    scale = AdapterOption("a scale", type=float)
    assert scale.problem(2.0) is None and scale.problem(2) is None  # an int is a float's value (JSON)
    assert scale.problem("big") == "expected a float, got str 'big'"
    assert AdapterOption("n", type=int).problem(True) == "expected a int, got bool True"
    assert AdapterOption("tile", type=list).problem((64, 64)) is None
    backend = AdapterOption("kernel", type=str, choices=("a", "b"))
    assert backend.problem("c") == "expected one of 'a', 'b'"
    assert AdapterOption("anything").problem(object()) is None


def test_flips_are_declared_or_derived():
    assert AdapterOption("flag", type=bool, default=False).flips(None) == (True,)
    assert AdapterOption("flag", type=bool).flips(True) == (False,)
    assert AdapterOption("kernel", type=str, choices=("a", "b", "c"), default="a").flips("b") == ("a", "c")
    assert AdapterOption("scale", type=float, default=1.0, alternatives=(2.0, 1.0)).flips(None) == (2.0,)
    untyped = AdapterOption("help only")
    assert not untyped.typed and untyped.flips("x") == ()


def test_declarations_are_normalised_and_checked():
    options = declared_options({"a": "help", "b": AdapterOption("b", type=bool)})
    assert options == {"a": AdapterOption("help"), "b": AdapterOption("b", type=bool)}
    with pytest.raises(TypeError, match="returned a list, not a mapping"):
        declared_options(["a"])
    with pytest.raises(TypeError, match="option 'a': an option is declared as AdapterOption"):
        declared_options({"a": 3})
    with pytest.raises(ValueError, match="an option's type must be one of"):
        AdapterOption("x", type=tuple)
