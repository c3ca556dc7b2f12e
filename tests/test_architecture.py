"""The package stays readable as it grows: rooms of small modules and short functions (the layers themselves are
import-linter contracts in pyproject.toml, run by CI as ``lint-imports``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvrunahead"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_400_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in _modules()}
    long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                # From ``def`` to the last line: a click command's option decorators are declarations, not code.
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_paper_nouns_are_rooms():
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert {"modes", "search", "bench", "model", "net", "sim", "cli"} <= rooms
    assert {"kvr.py", "tsp.py", "cp_allgather.py", "ring.py"} <= {p.name for p in (PACKAGE / "modes").iterdir()}


def test_from_the_engines_step_to_the_models_forward_is_at_most_five_calls():
    """Engine.step reads schedule, execute, update; the prompt's forward and the decode rows' are at most five of
    the package's calls below it (torch's and contextlib's wrappers not counted)."""
    import inspect

    from kvrunahead.config import RunConfig
    from kvrunahead.ranks.launcher import World
    from kvrunahead.serve.config import EngineConfig
    from kvrunahead.serve.engine import Engine
    from kvrunahead.serve.sequence import Request, SamplingParams

    engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1), prefix_cache_tokens=0),
                    World(0, 1, 0, 1, "single"))
    chains = []

    def calls_below_step(module, args, kwargs):
        chain = []
        for frame in inspect.stack()[1:]:
            if Path(frame.filename).resolve().is_relative_to(PACKAGE):
                if frame.function == "step" and frame.filename.endswith("serve/engine.py"):
                    chains.append(chain)
                    return
                chain.append(f"{Path(frame.filename).name}:{frame.function}")
        chains.append(None)  # a forward that did not come from Engine.step

    handle = engine.ctx.lm.model.register_forward_pre_hook(calls_below_step, with_kwargs=True)
    try:  # the model stays loaded for the process's later tests (ranks/setup.loaded_model): the hook goes with us
        engine.run_one(Request("r", list(range(5, 60)), SamplingParams(max_tokens=3)))
    finally:
        handle.remove()
    assert len(chains) == 3 and None not in chains  # the prompt, then two decode steps
    assert chains[0][-1] == "executor.py:run_step" and chains[0][0] == "forward.py:last_token_logits", chains[0]
    assert max(map(len, chains)) <= 5, chains


def test_a_plain_completion_from_the_route_to_the_forward_touches_at_most_23_serving_files():
    """Every file of serve/ whose code runs while one /v1/completions request is served in one process, counted with
    a profiler on every thread (the route's, the engine's). 23 today (one is the K,V pool the scheduler admits
    against); the house's target is 12."""
    import sys
    import threading

    from fastapi.testclient import TestClient

    from kvrunahead.config import RunConfig
    from kvrunahead.ranks.launcher import World
    from kvrunahead.serve.client import AsyncEngineClient
    from kvrunahead.serve.config import EngineConfig
    from kvrunahead.serve.engine import Engine
    from kvrunahead.serve.http.app import build_app

    serve, on, touched = str(PACKAGE / "serve"), [False], set()

    def profile(frame, event, arg):
        if on[0] and event == "call" and frame.f_code.co_filename.startswith(serve):
            touched.add(Path(frame.f_code.co_filename).relative_to(PACKAGE).as_posix())

    threading.setprofile(profile)  # the threads started from here on: the engine's, the test client's
    sys.setprofile(profile)
    try:
        engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1), prefix_cache_tokens=0),
                        World(0, 1, 0, 1, "single"))
        body = {"model": "tiny-llama", "prompt": "hello there, how are you", "max_tokens": 3, "temperature": 0}
        with TestClient(build_app(AsyncEngineClient(engine, "tiny-llama"))) as http:
            assert http.post("/v1/completions", json=body).status_code == 200  # the first: its one-time work
            on[0] = True
            assert http.post("/v1/completions", json=body).status_code == 200
            on[0] = False
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
    assert "serve/http/app.py" in touched and "serve/step/executor.py" in touched, touched
    assert len(touched) <= 23, sorted(touched)
