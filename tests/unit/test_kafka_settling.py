"""while_settling: what a restarting broker answers for a few seconds is waited out; anything
else is raised at once. (The broker restart itself is exercised in the integration tests.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka import KafkaError, KafkaException

from pin_pipelines.kafka import while_settling


def failing(
    times: int, code: int, retriable: bool = False
) -> tuple[Callable[[float], str], list[float]]:
    """A call that fails `times` times with `code`, then answers; records the time it was given."""
    calls: list[float] = []

    def call(seconds_left: float) -> str:
        calls.append(seconds_left)
        if len(calls) <= times:
            raise KafkaException(KafkaError(code, retriable=retriable))
        return "answer"

    return call, calls


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.UNKNOWN_LEADER_EPOCH,
    ],
)
def test_settling_errors_are_retried_until_the_broker_answers(code: int) -> None:
    call, calls = failing(2, code)
    assert while_settling(call, timeout=5) == "answer"
    assert len(calls) == 3


def test_errors_the_client_flags_retriable_are_retried_too() -> None:
    call, calls = failing(1, KafkaError._TRANSPORT, retriable=True)
    assert while_settling(call, timeout=5) == "answer"
    assert len(calls) == 2 and calls[1] < calls[0] <= 5


def test_other_errors_are_raised_at_once() -> None:
    call, calls = failing(1, KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        while_settling(call, timeout=5)
    assert len(calls) == 1


def test_a_settling_error_that_outlasts_the_timeout_is_raised() -> None:
    call, calls = failing(1000, KafkaError.NOT_COORDINATOR)
    with pytest.raises(KafkaException):
        while_settling(call, timeout=1)
    assert 2 <= len(calls) <= 4
