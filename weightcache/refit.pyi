"""weightcache's live refit: a trainer publishes a new version of a served model from its tensors; engines that
attached it switch in place (``LoadedModel.refit``). docs/refit.md says how, what is guaranteed and what it costs.
"""

# publish or stage a version
from weightcache.core.refit.publish import publish_version as publish_version, stage_version as stage_version
from weightcache.core.refit.publish import PublishedVersion as PublishedVersion, StagedVersion as StagedVersion

# errors
from weightcache.core.errors import VersionNotFound as VersionNotFound, LayoutMismatch as LayoutMismatch
