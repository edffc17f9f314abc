"""Refit: a trainer publishes a new version of a served model from tensors it holds; engines switch to it in place.

The trainer's side is here (``publish_version``); an engine switches with ``Attachment.fetch_version`` and
``Attachment.switch_to`` (``weightcache.core.client.attach``), or ``LoadedModel.refit`` (``weightcache.core.flow.modes``).
"""

from __future__ import annotations

from weightcache.core.refit.publish import PublishedVersion, StagedVersion, publish_version, stage_version

__all__ = ["PublishedVersion", "StagedVersion", "publish_version", "stage_version"]
