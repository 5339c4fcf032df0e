"""The one code location (workspace.yaml): every domain's definitions, merged."""

import dagster as dg

from pin_pipelines.defs import recalc
from pin_pipelines.defs.resources import RESOURCES

defs = dg.Definitions.merge(
    recalc.defs,
    dg.Definitions(resources=RESOURCES),
)
