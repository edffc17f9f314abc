"""weightcache for engine forks and integrations: fingerprint, publish, attach and rebind a model your engine owns;
run the load flow from an engine's own loader; keep a warm spare and compiled artifacts beside the weights.

docs/api.md and docs/engines.md show each call. Each name loads its module on first use.
"""

# engine forks that own their model code: fingerprint, publish, attach, rebind
from weightcache.core.flow.api import fingerprint as fingerprint, attach as attach, rebind as rebind
from weightcache.core.flow.api import publish_model as publish_model, publish_state as publish_state
from weightcache.core.flow.api import publish_checkpoint as publish_checkpoint
from weightcache.core.client.attach import Attachment as Attachment
from weightcache.core.fingerprint import Fingerprint as Fingerprint, ParallelSpec as ParallelSpec
from weightcache.core.flow.modes import ATTACHMENT_ATTR as ATTACHMENT_ATTR

# an engine's loader runs the flow: a request, the cache's options, the mode runner, or its two halves
from weightcache.core.flow.modes import run as run, CacheOptions as CacheOptions
from weightcache.core.request import LoadRequest as LoadRequest
from weightcache.core.flow.plugins import Plugins as Plugins
from weightcache.core.flow.loader import prepare as prepare, Prepared as Prepared, publish as publish
from weightcache.core.flow.loader import Published as Published, Origin as Origin, Tier as Tier
from weightcache.core.client.client import Connection as Connection

# fast starts: a warm spare, compile artifacts and compiled forwards beside the weights
from weightcache.core.spare.standby import Standby as Standby
from weightcache.core.spare.compile_cache import publish_artifacts as publish_artifacts
from weightcache.core.spare.compile_cache import restore_artifacts as restore_artifacts
from weightcache.core.spare.compiled_forward import CompiledForward as CompiledForward
from weightcache.core.spare.compiled_forward import compiled_forward as compiled_forward, compile_ahead as compile_ahead
from weightcache.core.spare.compiled_forward import publish_compiled as publish_compiled
from weightcache.core.spare.compiled_forward import restore_compiled as restore_compiled

# errors of these calls
from weightcache.core.errors import StandbyError as StandbyError
from weightcache.core.errors import CompileArtifactsUnavailable as CompileArtifactsUnavailable, ArenaError as ArenaError
