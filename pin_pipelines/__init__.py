"""pin-pipelines: the chessboard aggregates recalc and the dev-stats layout-group dimension."""

import os

# Before anything imports grpc (Dagster does): with gRPC's fork support on, as grpcio builds it,
# a process holding a gRPC channel that forks with a preexec_fn (a fork, not a vfork) restarts
# gRPC's poller thread in the child, and the child aborts (SIGABRT, "epoll_wait error: Bad file
# descriptor") when Python closes the inherited descriptors before exec: grpc/grpc#43055, open
# for grpcio 1.80 through the 1.85 we pin. `pin serve` pings its code server over gRPC and starts
# its children with a preexec_fn (PR_SET_PDEATHSIG), and `pin stack` and the tests start services
# the same way: CI saw `dagster dev` die at its start with -6. Nothing of ours uses gRPC in a
# forked child; an operator's own setting is kept. Read at gRPC's import, so it must be here.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
