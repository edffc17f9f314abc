"""Rebind in bulk (issue 21): a wide module's parameters bound in one call give the same model as record by record; a
module unfit for the bulk path is bound record by record; a bulk binding binds all or nothing."""

from __future__ import annotations

import pytest
import torch

from weightcache.core.errors import RebindError
from weightcache.core.layout.manifest import Manifest
from weightcache.core.layout.views import table_bindings
from weightcache.core.load import rebind as rebind_mod
from weightcache.core.load.export import ArenaBuilder, NamedTensor, export_tensors
from weightcache.core.load.rebind import rebind_module


class Wide(torch.nn.Module):
    """A module holding more Parameters than ``_BULK_MIN`` (rebind binds them as one list), of several shapes, with a
    buffer beside them and a small child bound record by record."""

    def __init__(self, count: int = 2 * rebind_mod._BULK_MIN):
        super().__init__()
        for index in range(count):
            self.register_parameter(f"p{index}", torch.nn.Parameter(torch.randn(3, index % 4 + 1)))
        self.register_buffer("scale", torch.rand(2))
        self.child = torch.nn.Linear(2, 2, bias=False)


def published_wide(count: int = 2 * rebind_mod._BULK_MIN) -> tuple[Wide, ArenaBuilder, Manifest]:
    torch.manual_seed(1)
    source = Wide(count)
    items = [NamedTensor(name, "parameter", t) for name, t in source.named_parameters()]
    items += [NamedTensor(name, "buffer", t) for name, t in source.named_buffers()]
    builder = ArenaBuilder("cpu")
    manifest = Manifest.from_wire(*export_tensors(items, {}, builder, release=False).to_wire(), trusted=True)
    return source, builder, manifest


def meta_wide(count: int = 2 * rebind_mod._BULK_MIN) -> Wide:
    with torch.device("meta"):
        return Wide(count)


def _bulk_calls(monkeypatch) -> list:
    """The results of rebind's bulk binding, one per call (a spy: the real function runs)."""
    results: list = []
    real = rebind_mod._bind_in_bulk
    monkeypatch.setattr(rebind_mod, "_bind_in_bulk", lambda *a: results.append(real(*a)) or results[-1])
    return results


@pytest.mark.parametrize("count", [rebind_mod._BULK_MIN - 1, rebind_mod._BULK_MIN, 3 * rebind_mod._BULK_MIN])
@pytest.mark.parametrize("fresh", [True, False], ids=["from the table", "from a dict"])
def test_a_wide_module_is_bound_in_bulk_and_gives_the_same_model(monkeypatch, count, fresh):
    source, builder, manifest = published_wide(count)
    try:
        results = _bulk_calls(monkeypatch)
        views = manifest.views(builder.arenas)
        model = rebind_module(meta_wide(count), views if fresh else dict(views), manifest)
        # The wide module's parameters in one go from _BULK_MIN entries (one by one below); the child's always one by one.
        assert results == ([True] if count >= rebind_mod._BULK_MIN else [])
        for name, tensor in source.state_dict().items():
            bound = model.get_parameter(name) if name != "scale" else model.scale
            assert torch.equal(bound, tensor) and bound.data_ptr() == views[name].data_ptr(), name
            assert type(bound) is (torch.nn.Parameter if name != "scale" else torch.Tensor) and not bound.requires_grad
        assert list(model._parameters) == [f"p{i}" for i in range(count)]  # the dict's order is kept
        assert not model.training
        del model, views
    finally:
        builder.close()


def _spoil(skeleton: Wide, how: str) -> None:
    """Make ``skeleton``'s wide module unfit for the bulk path, in one way each."""
    parameters = skeleton._parameters
    if how == "a wrong shape":
        parameters["p5"] = torch.nn.Parameter(torch.empty(3, 7, device="meta"))
    elif how == "another rank":
        parameters["p5"] = torch.nn.Parameter(torch.empty(3, 2, 1, device="meta"))
    elif how == "a Parameter subclass of a wrong shape":
        parameters["p5"] = type("Sub", (torch.nn.Parameter,), {})(torch.empty(4, 2, device="meta"))
    elif how == "a plain tensor of a wrong shape":
        parameters["p5"] = torch.empty(9, device="meta")
    elif how == "a meta Parameter the entry lacks":
        skeleton.register_parameter("extra", torch.nn.Parameter(torch.empty(2, device="meta")))
    elif how == "an entry of None":
        skeleton.register_parameter("p5", None)
    elif how == "another order":
        parameters["p0"] = parameters.pop("p0")
    elif how == "a key holding a dot":
        parameters["child.weight"] = torch.nn.Parameter(torch.empty(2, 2, device="meta"))
    elif how == "a Parameter subclass of the right shape":
        parameters["p5"] = type("Sub", (torch.nn.Parameter,), {})(torch.empty(3, 2, device="meta"))
    elif how == "a same-named buffer":
        skeleton._buffers["p5"] = torch.empty(3, 2, device="meta")


REFUSED = {
    "a wrong shape": r"'p5' has shape \(3, 2\), the model expects \(3, 7\)",
    "another rank": r"'p5' has shape \(3, 2\), the model expects \(3, 2, 1\)",
    "a Parameter subclass of a wrong shape": r"'p5' has shape \(3, 2\), the model expects \(4, 2\)",
    "a plain tensor of a wrong shape": r"'p5' has shape \(3, 2\), the model expects \(9,\)",
    "a meta Parameter the entry lacks": r"^1 tensors stayed on the meta device after rebind: extra;",
    "a key holding a dot": r"^1 tensors stayed on the meta device after rebind: child\.weight;",
}


ACCEPTED = ["an entry of None", "another order", "a Parameter subclass of the right shape"]


@pytest.mark.parametrize("how", [*REFUSED, *ACCEPTED, "a same-named buffer"])
@pytest.mark.parametrize("fresh", [True, False], ids=["from the table", "from a dict"])
def test_a_wide_module_unfit_for_the_bulk_path_is_bound_record_by_record(monkeypatch, how, fresh):
    """Each way a module can differ from its records makes the bulk path bind nothing and step aside; the record loop
    then refuses what it always refused, with its own message, and binds what it always bound. A buffer of a
    parameter's name is dropped by either path."""
    source, builder, manifest = published_wide()
    try:
        results = _bulk_calls(monkeypatch)
        skeleton = meta_wide()
        _spoil(skeleton, how)
        views = manifest.views(builder.arenas)
        tensors = views if fresh else dict(views)
        if how in REFUSED:
            with pytest.raises(RebindError, match=REFUSED[how]):
                rebind_module(skeleton, tensors, manifest)
            assert results == [False]
            return
        model = rebind_module(skeleton, tensors, manifest)
        assert results == [how not in ACCEPTED]
        for name, tensor in source.named_parameters():
            assert type(model.get_parameter(name)) is torch.nn.Parameter and torch.equal(model.get_parameter(name), tensor)
        assert "p5" not in model._buffers and torch.equal(model.scale, source.scale)
        del model, views, tensors
    finally:
        builder.close()


def test_bulk_binding_binds_all_or_nothing():
    """``_bind_in_bulk`` on its own: a fit binds every record into the dict's own keys; a misfit leaves the dict as it
    was (the same objects), whatever it is that does not fit."""
    _, builder, manifest = published_wide()
    try:
        bound = table_bindings(manifest.table, [arena.bytes_view() for arena in builder.arenas])
        parameters = [index for index, kind in enumerate(manifest.table.kind) if kind == 0]
        names = [manifest.table.names[i] for i in parameters]
        made, shapes = [bound.tensors[i] for i in parameters], [bound.shapes[i] for i in parameters]
        args = (names, made, shapes, 0, torch.nn.Parameter)
        for how in [*REFUSED, *ACCEPTED[:3]]:
            skeleton = meta_wide()
            _spoil(skeleton, how)
            before = dict(skeleton._parameters)
            assert not rebind_mod._bind_in_bulk(skeleton._parameters, skeleton._buffers, "", *args), how
            assert skeleton._parameters == before and all(skeleton._parameters[k] is v for k, v in before.items()), how
        skeleton = meta_wide()
        keys = list(skeleton._parameters)
        assert rebind_mod._bind_in_bulk(skeleton._parameters, skeleton._buffers, "", *args)
        assert list(skeleton._parameters) == keys and all(
            a is b for a, b in zip(skeleton._parameters.values(), made[: len(keys)], strict=True)
        )
        # Under a path: the names must be the keys under it, not the bare keys.
        skeleton = meta_wide()
        assert not rebind_mod._bind_in_bulk(skeleton._parameters, skeleton._buffers, "wide", *args)
        prefixed = (["wide." + name for name in names], *args[1:])
        assert rebind_mod._bind_in_bulk(skeleton._parameters, skeleton._buffers, "wide", *prefixed)
        # Fewer records than entries: the slice is short, nothing is bound.
        skeleton = meta_wide()
        short = names[: len(keys) - 1]
        assert not rebind_mod._bind_in_bulk(
            skeleton._parameters, skeleton._buffers, "", short, made, shapes, 0, torch.nn.Parameter
        )
        assert all(p.is_meta for p in skeleton._parameters.values())
    finally:
        builder.close()
