"""A pytest plugin for `tools.diffrax_tests`: writes every test's outcome, as
it finishes, to the JSON-lines file named by `$DFX_TESTS_STREAM`, so that a crash or
a kill of the run keeps what had finished; and puts the tests whose node ids contain
one of the comma-separated `$DFX_TESTS_FIRST` substrings at the front, one in every
two (pytest-xdist's load scheduling hands each worker two tests to start with: so
each of those long tests starts at once, on a worker of its own).

Loaded with `-p tools.diffrax_tests_plugin`; a no-op without `$DFX_TESTS_STREAM`.
Under pytest-xdist only the controller writes (the workers' reports reach it).
"""

import json
import os
import time

import pytest


_STATE: dict = {}


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def _write(record: dict) -> None:
    path = os.environ.get("DFX_TESTS_STREAM")
    if not path or not _STATE.get("controller"):
        return
    record["time"] = round(time.time() - _STATE["start"], 2)
    with open(path, "a") as f:  # one write per record: a kill keeps whole lines
        f.write(json.dumps(record) + "\n")
        f.flush()


def pytest_configure(config: pytest.Config) -> None:
    _STATE.update(controller=_controller(config), start=time.time())


def pytest_collection_modifyitems(session, config, items) -> None:
    del session, config
    first = [s for s in os.environ.get("DFX_TESTS_FIRST", "").split(",") if s]
    if not first:
        return
    slow = [i for i in items if any(s in i.nodeid for s in first)]
    rest = [i for i in items if not any(s in i.nodeid for s in first)]
    ordered = []
    for item in slow:
        ordered.append(item)
        if rest:
            ordered.append(rest.pop(0))
    items[:] = ordered + rest


def pytest_collection_finish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        ids = [item.nodeid for item in session.items]
        if ids:
            _write({"collected": ids})


def pytest_xdist_node_collection_finished(node, ids) -> None:
    del node
    if not _STATE.get("collected"):
        _STATE["collected"] = True
        _write({"collected": list(ids)})


def pytest_collectreport(report) -> None:
    if report.failed:
        message = str(report.longrepr).strip().splitlines()
        _write(
            {
                "nodeid": report.nodeid,
                "when": "collect",
                "outcome": "failed",
                "message": message[-1][:300] if message else "",
            }
        )


def pytest_runtest_logreport(report) -> None:
    record = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration": round(report.duration, 3),
    }
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
        record["message"] = message.strip().splitlines()[0][:300] if message else ""
    _write(record)
