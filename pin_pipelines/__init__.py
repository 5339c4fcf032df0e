"""pin-pipelines: the chessboard aggregates recalc and the dev-stats layout-group dimension."""
