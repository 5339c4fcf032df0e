"""The one door to the dimension's online reads: an `Actor` (spec 003, security: access is the
developer's role, permission `dev-stats.view`, and scope strictly the actor's own DeveloperId;
every query filters `DeveloperId = actor`).

Every online read (`devstats.reads`) takes an `Actor`, never a developer id, so the scope of a
read is whoever proved to be that developer. An `Actor` cannot be constructed: it is made only
by a *door*, a subclass of `ActorDoor`, and only two classes may be doors, named in `_DOORS`:

- `pin_pipelines.api.auth.TokenVerifier`: the read API's bearer token, verified (signature by a
  key of the identity provider's JWKS, issuer, audience, expiry, role and permission); the
  developer is the token's `developer_id` claim and nothing else.
- `pin_pipelines.devstats.operator.OperatorDoor`: an operator who has the dimension's settings
  and runs `pin devstats labels --developer-id` (the contract's command), or a test or bench. It
  names the developer on purpose; the API package can never import it
  (tests/unit/test_layering.py), so no request can take that path.

Python has no private constructors; what this module does is make every other way explicit and
checked: `Actor(...)` raises, a subclass of `ActorDoor` under any other name raises at class
creation (a subclass of a door too), an Actor does not pickle (which would rebuild one from
bytes), and tests/unit/test_api_actor.py fails when any module but this one builds an Actor
(`object.__new__(Actor)`) or calls a door's `_admit` outside the two doors. The operator reads
that see every developer (the loader's version guard, the reconciliation) take no Actor at all
and live in modules the API cannot reach (devstats/dim.py, reconcile/).
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn, final
from uuid import UUID

#: The classes allowed to make Actors (module.qualname), and the name each gives its Actors.
_DOORS = {
    "pin_pipelines.api.auth.TokenVerifier": "token",
    "pin_pipelines.devstats.operator.OperatorDoor": "operator",
}


@final
class Actor:
    """The developer a read is for, as a door proved it: `developer_id` scopes every query,
    `subject` says who acted (the token's `sub`; `operator` for the operator's door) and `door`
    which door made it (`token`, `operator`), for the request log. Immutable."""

    __slots__ = ("developer_id", "door", "subject")
    developer_id: UUID
    subject: str
    door: str

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            "an Actor is not constructed: it comes from a verified token "
            "(pin_pipelines.api.auth.TokenVerifier) or from the operator's door "
            "(pin_pipelines.devstats.operator.operator_actor)"
        )

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("an Actor is immutable")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError("an Actor is immutable")

    def __reduce__(self) -> NoReturn:
        """Refused: unpickling would build an Actor from bytes, past every door."""
        raise TypeError("an Actor cannot be pickled or copied into another process")

    def __copy__(self) -> Actor:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Actor:
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Actor):
            return NotImplemented
        return (self.developer_id, self.subject, self.door) == (
            other.developer_id,
            other.subject,
            other.door,
        )

    def __hash__(self) -> int:
        return hash((self.developer_id, self.subject, self.door))

    def __repr__(self) -> str:
        return f"Actor({self.developer_id}, subject={self.subject!r}, door={self.door})"


class ActorDoor:
    """Base of the only two classes that make Actors (see `_DOORS` and the module docstring).

    A subclass under any other name fails when its class statement runs, so a new way into the
    dimension's online reads cannot appear without a change to this module."""

    door: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name not in _DOORS:
            raise TypeError(
                f"{name} cannot make Actors: the doors to the dimension's online reads are "
                f"{', '.join(sorted(_DOORS))} (pin_pipelines/devstats/actor.py)"
            )
        cls.door = _DOORS[name]

    @final
    def _admit(self, developer_id: UUID, subject: str) -> Actor:
        """The Actor this door vouches for; called by the door itself once it has checked."""
        if type(self).__module__ + "." + type(self).__qualname__ not in _DOORS:
            raise TypeError("only a door makes Actors")
        if not isinstance(developer_id, UUID):
            raise TypeError(f"an Actor's developer_id is a UUID, got {type(developer_id).__name__}")
        actor = object.__new__(Actor)
        for name, value in (("developer_id", developer_id), ("subject", subject)):
            object.__setattr__(actor, name, value)
        object.__setattr__(actor, "door", self.door)
        return actor
