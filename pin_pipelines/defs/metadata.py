"""Values of the assets' and checks' metadata."""

from typing import Any

import dagster as dg

#: Ids listed in metadata, ready to paste into a job's config (force_recalc_job's project_ids).
LISTED_IDS = 200


def id_list(ids: list[Any]) -> dg.MetadataValue:
    """The first LISTED_IDS ids as a JSON list of strings."""
    return dg.MetadataValue.json([str(i) for i in ids[:LISTED_IDS]])
