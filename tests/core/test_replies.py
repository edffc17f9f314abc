"""The server's replies decoded into typed values in one place (core/client/replies.py): what a newer or an older
server sends decodes, anything else is a ProtocolError that names the field."""

from __future__ import annotations

import pytest

from weightcache.core.client.replies import HeldEntry, PublishReply, ServerStatus
from weightcache.core.errors import ProtocolError

ROW = {"digest": "d" * 64, "label": "tiny (TinyLM, hf)", "bytes": 1024, "tier": "host", "attached_pids": [12]}


def test_a_publish_reply_decodes():
    assert PublishReply.from_json({"ok": True, "digest": "a" * 64, "created": False}) == PublishReply("a" * 64, False)


@pytest.mark.parametrize(
    ("reply", "field"),
    [({"digest": "a", "created": 1}, "created"), ({"created": True}, "digest"), ({"digest": 7, "created": True}, "digest")],
)
def test_a_garbled_publish_reply_names_its_field(reply, field):
    with pytest.raises(ProtocolError, match=f"publish reply holds .* as {field}; run the same weightcache version"):
        PublishReply.from_json(reply)


def test_a_status_reply_decodes_with_its_budgets():
    status = ServerStatus.from_json({"entries": [ROW], "budgets": {"total": 4096, "host": None, "per_gpu": 2048}})
    assert status.entries == (HeldEntry("d" * 64, "tiny (TinyLM, hf)", 1024, "host", (12,)),)
    assert status.budgets == {"total": 4096, "host": None, "per_gpu": 2048}
    assert status.held(["d" * 64, "e" * 64]) == {"d" * 64: status.entries[0]}


def test_an_older_servers_status_reply_decodes():
    """No ``budgets`` (one ``byte_budget``), no ``tier`` or ``label`` in a row: what that server meant."""
    old_row = {key: value for key, value in ROW.items() if key not in ("tier", "label")}
    status = ServerStatus.from_json({"entries": [old_row], "byte_budget": 8192})
    assert status.budgets == {"total": 8192} and status.entries[0].tier == "" and status.entries[0].label == ""


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        ({}, "as entries"),
        ({"entries": ["x"]}, "a row that is not an object"),
        ({"entries": [{**ROW, "bytes": True}]}, "as bytes"),
        ({"entries": [{**ROW, "bytes": "1024"}]}, "as bytes"),
    ],
)
def test_a_garbled_status_reply_is_a_protocol_error(reply, problem):
    with pytest.raises(ProtocolError, match=problem):
        ServerStatus.from_json(reply)
