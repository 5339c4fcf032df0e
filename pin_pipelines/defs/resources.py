"""The one resource every domain uses: the contract's settings, read at run time by ops, asset
checks and sensors alike."""

import dagster as dg

from pin_pipelines.config import Settings
from pin_pipelines.logs import configure_run_logging


class PinSettings(dg.ConfigurableResource):
    """Environment-driven (contract section 1), so the UI, the daemon and `pin` agree."""

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        # Every op of the project uses this resource: its run's pin_pipelines lines go to the
        # run's stdout from here on. Sensors use it too, outside any run (context.run is None):
        # the code server's logging is left as it is.
        if context.run is not None:
            configure_run_logging()

    def get(self) -> Settings:
        return Settings.from_env()


RESOURCES = {"pin": PinSettings()}

#: The chessboard aggregates in PostgreSQL: written by the drain, read by the relay's topics.
CHESSBOARD_AGGREGATES = dg.AssetKey(["chessboard", "aggregates"])
