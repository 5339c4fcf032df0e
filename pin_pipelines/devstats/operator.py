"""The operator's door to the dimension's online reads: an `Actor` for a developer named by the
caller, not proved by a token.

Why an operator path at all: the contract's `pin devstats labels --developer-id UUID` answers
"what does this developer see", and the one answering it is an operator who already holds the
dimension's settings (PIN_CLICKHOUSE_URL and its credentials, or the chdb folder): nothing a
token could add to what they can read directly. Giving them an `Actor` through this clearly
named door, instead of a second set of reads by raw developer id, keeps one implementation of
the scoped reads (devstats/reads.py) and makes every impersonation greppable
(`operator_actor(`): the CLI, the operator reads of devstats/dim.py, tests and benches.

Why it is safe: nothing that serves requests can reach it. The read API's package may not
import this module, directly or through another module (tests/unit/test_layering.py), so a
request's Actor can only come from `pin_pipelines.api.auth.TokenVerifier`.
"""

from __future__ import annotations

from uuid import UUID

from pin_pipelines.devstats.actor import Actor, ActorDoor

#: The `subject` of an operator's Actor (a token's Actor carries the token's `sub`).
OPERATOR_SUBJECT = "operator"


class OperatorDoor(ActorDoor):
    """Vouches for whatever developer the operator names: the caller is trusted by having the
    dimension's settings (see the module docstring)."""

    def actor(self, developer_id: UUID) -> Actor:
        return self._admit(developer_id, OPERATOR_SUBJECT)


def operator_actor(developer_id: UUID) -> Actor:
    """The Actor of `developer_id` for an operator's read (`pin devstats labels --developer-id`)."""
    return OperatorDoor().actor(developer_id)
