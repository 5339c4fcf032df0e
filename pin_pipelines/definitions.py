"""The one code location (workspace.yaml): every domain's definitions, merged."""

import warnings

import dagster as dg

from pin_pipelines.defs import devstats, housekeeping, recalc, reconcile, relay
from pin_pipelines.defs.resources import RESOURCES

# Dagster flags its own internal use of beta parameters on every load; it is not ours to act on.
warnings.filterwarnings("ignore", category=dg.BetaWarning)

defs = dg.Definitions.merge(
    recalc.defs,
    relay.defs,
    devstats.defs,
    reconcile.defs,
    housekeeping.defs,
    dg.Definitions(resources=RESOURCES),
)
