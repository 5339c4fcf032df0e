"""The recalc queue protocol, model-checked: model/recalc_queue.pml with Spin.

Exhaustive searches of the model (N = 2 writers, M = 2 drains, one project; see the model's
header for the abstraction and the SQL each step stands for):

- the safety search (-DSAFETY): the assertions of properties 1-4 (no trigger lost, one drain at
  a time in a project's work transaction, the starvation cap, poison after exactly 5 failed
  attempts) in every state, no deadlock, and every final state recalculated or poisoned;
- the liveness search (-a) of the LTL formula no_trigger_lost on every run (the model needs no
  fairness assumption, so this is stronger than -a -f: see the model's header);
- each deliberately broken variant (-DBUG_...) must fail, with the property it breaks;
- each reachability probe (-DREACH_...) must be reached, so the checks are not vacuous.

Every search must be complete: no "max search depth too small", no "Search not completed" for
the runs that must pass. The runs go in parallel (one per core) in a module fixture, so that
all of them end before any test's process-hygiene check (tests/conftest.py) begins. Without
`spin` or a C compiler every test fails (bin/test installs the Debian packages spin and gcc).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[2] / "model" / "recalc_queue.pml"
#: Far above the depth the searches reach (about 200 safe, 300 live): reaching it would be
#: reported as "max search depth too small" and fail the run.
MAX_DEPTH = "-m10000"
#: A search that runs longer is a model that grew out of its budget (the module: ~60 s).
TIMEOUT_SECONDS = 300

SAFETY = ("-DSAFETY", "-DNOCLAIM")  # assertions and end states; the LTL claim left out
LIVENESS = ()  # acceptance cycles against the never claim of no_trigger_lost


@dataclass(frozen=True)
class Run:
    """One verification: spin's defines, pan's compile flags and its run-time flags."""

    name: str
    defines: tuple[str, ...] = ()
    compile_flags: tuple[str, ...] = SAFETY
    pan_flags: tuple[str, ...] = ()
    #: The big searches are worth -O2's compile time; the short ones stop at their first error.
    optimize: str = "-O0"


@dataclass(frozen=True)
class Result:
    run: Run
    output: str
    seconds: float
    trail: bool

    @property
    def errors(self) -> int:
        found = re.search(r"errors: (\d+)", self.output)
        assert found, f"{self.run.name}: no verdict in pan's output:\n{self.output}"
        return int(found.group(1))

    @property
    def states(self) -> int:
        found = re.search(r"(\d+) states, stored", self.output)
        return int(found.group(1)) if found else 0

    @property
    def depth(self) -> int:
        found = re.search(r"depth reached (\d+)", self.output)
        return int(found.group(1)) if found else 0

    def summary(self) -> str:
        return (
            f"{self.run.name}: {self.errors} errors, {self.states} states stored, depth"
            f" {self.depth}, {self.seconds:.1f} s"
        )


PASSING = {
    "safety": Run("safety", optimize="-O2"),
    "liveness": Run("liveness", compile_flags=LIVENESS, pan_flags=("-a",), optimize="-O2"),
}

#: variant -> (its defines, the compile flags, pan's flags, text pan reports for the violation)
BROKEN = {
    # Without the re-lock the claimed row is unlocked during the work: another drain's tick
    # settles the live claim as abandoned and claims the row again, so the attempt is counted
    # twice (4), on the way to both drains in the work at once (2, found further on).
    "no_relock_two_drains": (
        ("-DBUG_NO_RELOCK",),
        SAFETY,
        (),
        "assertion violated ( !(row)||(((attempts+abandoned)==(failures+settled))&&(attempts<=5)))",
    ),
    "no_relock_request_lost": (
        ("-DBUG_NO_RELOCK", "-DND=1"),
        SAFETY,
        (),
        "assertion violated (seen==committed)",
    ),
    "no_cap": (("-DBUG_NO_CAP",), SAFETY, (), "assertion violated (due_at<=(first_at+3))"),
    "claim_no_lock": (
        ("-DBUG_CLAIM_NO_LOCK",),
        SAFETY,
        (),
        "assertion violated ((attempts<5)&&(failures<5))",
    ),
    "release_unguarded": (
        ("-DBUG_RELEASE_UNGUARDED",),
        SAFETY,
        (),
        "assertion violated ( !(row)||(((attempts+abandoned)==(failures+settled))&&(attempts<=5)))",
    ),
    "lease_no_expiry_final_state": (
        ("-DBUG_LEASE_NO_EXPIRY",),
        SAFETY,
        (),
        "assertion violated ((fresh==committed)||(row&&(attempts>=5)))",
    ),
    # -A: assertions ignored, so the LTL formula itself must catch the parked row.
    "lease_no_expiry_ltl": (("-DBUG_LEASE_NO_EXPIRY",), LIVENESS, ("-a", "-A"), "acceptance cycle"),
}

PROBES = (
    "POISON",
    "POISON_VIEW_EARLY",
    "INSERT_AFTER_WAIT",
    "DEFER",
    "SUPERSEDED",
    "RELOCK_TIMEOUT",
    "DEATH",
    "STOP",
    "FAILURE",
    "TIMEOUT",
    "PENDING_END",
)


def _runs() -> list[Run]:
    runs = list(PASSING.values())
    runs += [
        Run(f"bug:{name}", defines, flags, pan_flags)
        for name, (defines, flags, pan_flags, _) in BROKEN.items()
    ]
    runs += [Run(f"probe:{probe}", (f"-DREACH_{probe}",)) for probe in PROBES]
    return runs


def _missing_tools() -> list[str]:
    missing = []
    if shutil.which("spin") is None:
        missing.append("spin (Debian package spin: bin/test installs it)")
    if shutil.which("cc") is None:
        missing.append("cc, to compile pan (Debian package gcc: bin/test installs it)")
    if shutil.which("gcc") is None:
        missing.append("gcc, spin's preprocessor (Debian package gcc: bin/test installs it)")
    return missing


def _verify(run: Run, workdir: Path) -> Result:
    """spin -a, cc, pan in a folder of the run's own; the whole of pan's output."""
    workdir.mkdir()
    model = workdir / MODEL.name
    shutil.copyfile(MODEL, model)
    started = time.monotonic()

    def step(*argv: str) -> str:
        done = subprocess.run(
            argv,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(
                f"{run.name}: {' '.join(argv)} exited {done.returncode}:\n"
                f"{done.stdout}\n{done.stderr}"
            )
        return done.stdout

    step("spin", *run.defines, "-a", model.name)
    step("cc", run.optimize, "-w", *run.compile_flags, "-o", "pan", "pan.c")
    output = step("./pan", MAX_DEPTH, *run.pan_flags)
    trail = (workdir / f"{model.name}.trail").exists()
    return Result(run, output, time.monotonic() - started, trail)


Results = dict[str, Result | BaseException]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Results]:
    """Every run of this module, in parallel, finished before the first test begins (empty
    without the tools: each test then fails saying what is missing). A run that could not
    finish is kept as its exception, for its own test to report."""
    if _missing_tools():
        yield {}
        return
    root = tmp_path_factory.mktemp("spin")
    runs = _runs()  # the long liveness search first: the others share the other cores
    workers = min(4, max(2, len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {
            run.name: pool.submit(_verify, run, root / re.sub(r"\W", "_", run.name)) for run in runs
        }
        done: Results = {}
        for name, future in futures.items():
            error = future.exception()
            done[name] = error if error is not None else future.result()
    yield done


def _result(results: Results, name: str) -> Result:
    missing = _missing_tools()
    if missing:
        pytest.fail("the model checker cannot run, missing: " + "; ".join(missing), pytrace=False)
    result = results[name]
    if isinstance(result, BaseException):
        pytest.fail(f"{name}: {result}", pytrace=False)
    return result


def _assert_complete(result: Result) -> None:
    out = result.output
    assert "max search depth too small" not in out, result.summary()
    assert "Search not completed" not in out, result.summary()
    assert "Full statespace search for:" in out, out
    assert "out of memory" not in out, out


def test_safety_properties_hold_in_every_state(results: Results) -> None:
    """Properties 1-4 as assertions, deadlock freedom and the final states: 0 errors, with the
    state space searched to its end."""
    result = _result(results, "safety")
    print(result.summary())
    _assert_complete(result)
    assert result.errors == 0, result.output
    assert re.search(r"assertion violations\s+\+", result.output), result.output
    assert re.search(r"invalid end states\s+\+", result.output), result.output
    # The configuration the model's header describes (a shrunk model would pass vacuously).
    assert result.states > 1_000_000, result.summary()


def test_no_trigger_is_lost_on_any_run(results: Results) -> None:
    """The LTL formula no_trigger_lost, checked for acceptance cycles on every run."""
    result = _result(results, "liveness")
    print(result.summary())
    _assert_complete(result)
    assert result.errors == 0, result.output
    assert re.search(r"never claim\s+\+ \(no_trigger_lost\)", result.output), result.output
    assert re.search(r"acceptance\s+cycles\s+\+", result.output), result.output
    assert result.states > 1_000_000, result.summary()


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_a_broken_protocol_is_caught(results: Results, variant: str) -> None:
    """Each deliberately broken variant fails, on the property it breaks, with a trail."""
    result = _result(results, f"bug:{variant}")
    print(result.summary())
    expected = BROKEN[variant][3]
    assert result.errors >= 1, result.output
    assert expected in result.output, result.output
    assert result.trail, f"{variant}: no counterexample trail written"


@pytest.mark.parametrize("probe", PROBES)
def test_the_checked_situations_are_reachable(results: Results, probe: str) -> None:
    """A probe asserts that its situation never happens: spin must find it (a poisoned row, a
    deferral, a superseded claim, a death, ...), or the checks above could hold vacuously."""
    result = _result(results, f"probe:{probe}")
    print(result.summary())
    assert result.errors == 1, result.output
    assert "assertion violated  !(" in result.output, result.output
    assert result.trail, f"{probe}: no trail written"
