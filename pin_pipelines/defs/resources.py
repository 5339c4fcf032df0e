"""The one resource every domain uses: the contract's settings, read at run time."""

import dagster as dg

from pin_pipelines.config import Settings


class PinSettings(dg.ConfigurableResource):
    """Environment-driven (contract section 1), so the UI, the daemon and `pin` agree."""

    def get(self) -> Settings:
        return Settings.from_env()


RESOURCES = {"pin": PinSettings()}

#: The chessboard aggregates in PostgreSQL: written by the drain, read by the relay's topics.
CHESSBOARD_AGGREGATES = dg.AssetKey(["chessboard", "aggregates"])
