"""The one code location (workspace.yaml): every domain's definitions, merged."""

import warnings

import dagster as dg

from pin_pipelines.defs import code_server, devstats, housekeeping, recalc, reconcile, relay
from pin_pipelines.defs.resources import RESOURCES

# Dagster flags its own internal use of beta parameters on every load; it is not ours to act on.
warnings.filterwarnings("ignore", category=dg.BetaWarning)
# The code server loading these definitions ends when told to, also after a storage error.
code_server.harden()

defs = dg.Definitions.merge(
    recalc.defs,
    relay.defs,
    devstats.defs,
    reconcile.defs,
    housekeeping.defs,
    # Every step in the run's own process: a step in a process of its own costs a start-up
    # (seconds on two cores) and ~9 event-log rows (worker, resource and log-capture events),
    # a third of a load run's rows; the jobs' steps are short and sequential anyway.
    dg.Definitions(resources=RESOURCES, executor=dg.in_process_executor),
)
