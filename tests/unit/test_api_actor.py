"""The one door to the dimension's online reads (devstats/actor.py): an `Actor` that only
token verification (api/auth.py) or the operator's explicit door (devstats/operator.py) makes,
and reads that take nothing else. No service is needed: signatures and source are inspected,
and the run-time refusals happen before any statement.
"""

from __future__ import annotations

import ast
import copy
import inspect
import pickle
import typing
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from pin_pipelines.api.auth import TokenVerifier
from pin_pipelines.clickhouse import ClickHouse
from pin_pipelines.devstats import reads
from pin_pipelines.devstats.actor import Actor, ActorDoor
from pin_pipelines.devstats.operator import OperatorDoor, operator_actor
from tests.unit.test_layering import MODULES, PACKAGE_DIR, api_modules, reachable

#: The modules allowed to build Actors or call a door's `_admit`: the type and its two doors.
DOOR_MODULES = {
    "pin_pipelines.devstats.actor",
    "pin_pipelines.api.auth",
    "pin_pipelines.devstats.operator",
}


def online_reads() -> list[Callable[..., Any]]:
    """Every public function of the scoped reads module, and of any devstats module the API
    reaches, that takes a ClickHouse client: the dimension's online reads."""
    modules = [reads] + [
        __import__(name, fromlist=["_"])
        for name in sorted(reachable(api_modules()))
        if name.startswith("pin_pipelines.devstats.") and name != reads.__name__
    ]
    found = []
    for module in modules:
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("_") or function.__module__ != module.__name__:
                continue
            if ClickHouse in typing.get_type_hints(function).values():
                found.append(function)
    return found


def test_every_online_read_takes_an_actor_and_no_raw_developer_id() -> None:
    """Tried: the signature of each online read (labels, groups, and any added later). Each has
    a parameter typed Actor, and none typed UUID or str that could name a developer; `readable`
    (the health probe) reads no row and takes neither."""
    found = online_reads()
    names = {f.__name__ for f in found}
    assert {"labels", "groups", "readable"} <= names, names
    for function in found:
        hints = typing.get_type_hints(function)
        parameters = inspect.signature(function).parameters
        assert not {"developer_id", "tenant_id", "developer"} & set(parameters), function
        if function is reads.readable:
            assert list(parameters) == ["ch"]
            continue
        actors = [name for name in parameters if hints.get(name) is Actor]
        assert actors == ["actor"], f"{function.__qualname__} takes no Actor: {hints}"
        for name in parameters:
            assert hints[name] not in (uuid.UUID, str), f"{function.__qualname__}({name})"


@pytest.mark.parametrize("read", [reads.labels, reads.groups])
def test_a_read_refuses_a_developer_id_at_run_time_too(read: Callable[..., Any]) -> None:
    """An untyped caller passing a developer's UUID where the Actor goes: TypeError before any
    statement (the client is None: nothing is read)."""
    args: list[Any] = [None, uuid.uuid4()]
    if read is reads.labels:
        args.append([uuid.uuid4()])
    with pytest.raises(TypeError, match="take an Actor"):
        read(*args)


def test_an_actor_cannot_be_constructed_changed_or_pickled() -> None:
    actor = operator_actor(uuid.uuid4())
    with pytest.raises(TypeError, match="not constructed"):
        Actor(uuid.uuid4(), "someone", "token")
    with pytest.raises(TypeError, match="not constructed"):
        Actor()
    with pytest.raises(AttributeError, match="immutable"):
        actor.developer_id = uuid.uuid4()  # type: ignore[misc]
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(actor)
    assert copy.copy(actor) is actor and copy.deepcopy(actor) is actor


def test_only_the_two_doors_exist() -> None:
    """A new subclass of ActorDoor, or of a door, fails at its class statement; the base itself
    makes nothing."""
    assert TokenVerifier.door == "token" and OperatorDoor.door == "operator"
    with pytest.raises(TypeError, match="cannot make Actors"):

        class Forged(ActorDoor):
            pass

    with pytest.raises(TypeError, match="cannot make Actors"):

        class ForgedVerifier(TokenVerifier):
            pass

    with pytest.raises(TypeError, match="only a door"):
        ActorDoor()._admit(uuid.uuid4(), "someone")


def test_the_operator_door_names_its_actors() -> None:
    developer = uuid.uuid4()
    actor = operator_actor(developer)
    assert (actor.developer_id, actor.subject, actor.door) == (developer, "operator", "operator")
    with pytest.raises(TypeError, match="UUID"):
        operator_actor(str(developer))  # type: ignore[arg-type]


def _forgeries(module: str) -> list[str]:
    """Where a module builds an Actor past the doors (`object.__new__(Actor)`,
    `Actor.__new__(…)`) or calls a door's `_admit`."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "_admit":
            found.append(f"{module}:{node.lineno} calls _admit")
        if isinstance(node, ast.Call) and any(
            isinstance(arg, ast.Name) and arg.id == "Actor" for arg in node.args
        ):
            callee = ast.unparse(node.func)
            if callee.endswith("__new__"):
                found.append(f"{module}:{node.lineno} {callee}(Actor)")
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "__new__"
            and isinstance(node.value, ast.Name)
            and node.value.id == "Actor"
        ):
            found.append(f"{module}:{node.lineno} Actor.__new__")
    return found


def test_no_module_but_the_doors_makes_an_actor() -> None:
    """Tried: the source of every module of the package (the doors' own modules excepted):
    none calls `_admit` or builds an Actor with `__new__`; the doors' modules do (so the check
    sees what it looks for)."""
    assert PACKAGE_DIR.is_dir()
    outside = [hit for name in MODULES if name not in DOOR_MODULES for hit in _forgeries(name)]
    assert outside == []
    assert _forgeries("pin_pipelines.devstats.actor")
    assert _forgeries("pin_pipelines.api.auth") and _forgeries("pin_pipelines.devstats.operator")
