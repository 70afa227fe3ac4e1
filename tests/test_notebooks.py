"""The notebooks in notebooks/ stay runnable as the benchmarks change.

Each notebook runs one benchmark script (``subprocess.run([python,
benchmarks/X.py, args...])``) and then reads the JSON it wrote. Nothing here
runs a benchmark: the notebook's code cells are executed in order up to that
call, with ``subprocess.run`` recording the command line instead of running
it, and the arguments are then handed to the benchmark's own argument parsing
(its ``main()``, stopped at ``harness.setup_device``, the first thing every
benchmark does after parsing), so that a renamed or removed flag, or a value
the benchmark's checks reject, fails here rather than in the user's Jupyter.
A few seconds in all.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
BENCHMARKS_DIR = ROOT / "benchmarks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
# benchmarks/ modules that are not benchmarks: shared code, and the GPU
# session's collector of the others' JSON
NOT_BENCHMARKS = {"harness", "models", "gpu_session"}

sys.path.insert(0, str(BENCHMARKS_DIR))

import harness  # noqa: E402

import reprop  # noqa: E402

CELL_ID = re.compile(r"^[a-zA-Z0-9-_]{1,64}$")  # nbformat 4.5's cell id


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def code_cells(nb: dict) -> list[str]:
    return [source(c) for c in nb["cells"] if c["cell_type"] == "code"]


def test_every_benchmark_has_a_notebook():
    benchmarks = {p.stem for p in BENCHMARKS_DIR.glob("*.py")} - NOT_BENCHMARKS
    assert benchmarks, f"no benchmark scripts in {BENCHMARKS_DIR}"
    missing = sorted(name for name in (f"{b}_benchmark.ipynb" for b in benchmarks)
                     if not (NOTEBOOKS_DIR / name).is_file())
    assert not missing, f"benchmarks without a notebook in {NOTEBOOKS_DIR}: {', '.join(missing)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_nbformat4_without_outputs(path):
    nb = load(path)
    assert nb.get("nbformat") == 4, f"{path.name}: nbformat {nb.get('nbformat')!r}, want 4"
    minor = nb.get("nbformat_minor")
    assert isinstance(minor, int) and minor >= 0, f"{path.name}: nbformat_minor {minor!r}"
    assert isinstance(nb.get("metadata"), dict), f"{path.name}: no notebook metadata"
    assert isinstance(nb.get("cells"), list) and nb["cells"], f"{path.name}: no cells"
    ids = []
    for i, cell in enumerate(nb["cells"]):
        where = f"{path.name} cell {i}"
        assert cell.get("cell_type") in ("markdown", "code", "raw"), f"{where}: cell_type {cell.get('cell_type')!r}"
        assert isinstance(cell.get("metadata"), dict), f"{where}: no metadata"
        src = cell.get("source")
        assert isinstance(src, str) or (isinstance(src, list) and all(isinstance(s, str) for s in src)), \
            f"{where}: source is neither a string nor a list of strings"
        if minor >= 5:  # nbformat 4.5 requires a unique id per cell
            assert isinstance(cell.get("id"), str) and CELL_ID.match(cell["id"]), f"{where}: id {cell.get('id')!r}"
            ids.append(cell["id"])
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{where}: stored outputs (clear them before committing)"
            assert "execution_count" in cell and cell["execution_count"] is None, \
                f"{where}: execution_count {cell.get('execution_count')!r} (clear it before committing)"
        else:
            assert "outputs" not in cell and "execution_count" not in cell, \
                f"{where}: a {cell['cell_type']} cell with outputs"
    assert len(ids) == len(set(ids)), f"{path.name}: duplicate cell ids"
    assert nb["cells"][0]["cell_type"] == "markdown", \
        f"{path.name}: should open with a markdown cell saying what it times"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_validates_against_nbformat_schema(path):
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.from_dict(load(path)))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_compiles(path):
    for i, src in enumerate(code_cells(load(path))):
        compile(src, f"{path.name}[code cell {i}]", "exec")


class Parsed(Exception):
    """Raised by the patched harness.setup_device: the benchmark's arguments were accepted."""

    def __init__(self, args):
        super().__init__("parsed")
        self.namespace = args


def notebook_command(path: Path, cuda: bool, monkeypatch) -> tuple[list[str], dict, dict]:
    """Execute ``path``'s code cells in order from the notebooks folder, with
    reprop.cuda_available() returning ``cuda``, until one calls subprocess.run;
    return that call's argv, its keyword arguments and the notebook's namespace."""
    calls = []

    def record(cmd, *args, **kwargs):
        calls.append((list(cmd), args, kwargs))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    def refuse(*args, **kwargs):
        raise AssertionError(f"{path.name} starts a process other than through subprocess.run: {args}")

    monkeypatch.setattr(subprocess, "run", record)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(reprop, "cuda_available", lambda: cuda)
    monkeypatch.chdir(NOTEBOOKS_DIR)
    namespace = {"__name__": "__main__", "__file__": str(path)}
    for i, src in enumerate(code_cells(load(path))):
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(src, f"{path.name}[code cell {i}]", "exec"), namespace)
        if calls:
            break
    assert len(calls) == 1, f"{path.name}: no code cell runs a benchmark with subprocess.run"
    cmd, args, kwargs = calls[0]
    assert not args, f"{path.name}: subprocess.run's options should be keywords"
    return cmd, kwargs, namespace


def parse_benchmark_args(script: Path, argv: list[str], monkeypatch):
    """The namespace benchmark ``script``'s main() builds from ``argv``; a
    rejected argument fails the test with the benchmark's own message."""
    module = importlib.import_module(script.stem)

    def stop(args):
        raise Parsed(args)

    monkeypatch.setattr(harness, "setup_device", stop)
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            module.main()
    except Parsed as parsed:
        return parsed.namespace
    except SystemExit as e:
        rejected = f"{script.name} rejects {' '.join(argv)} (exit {e.code}): {err.getvalue().strip()}"
    else:
        rejected = None
    pytest.fail(rejected or f"{script.name}'s main() returned without calling harness.setup_device: "
                            "this check cannot stop it after parsing")


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_its_benchmark_with_accepted_arguments(path, cuda, monkeypatch):
    cmd, kwargs, namespace = notebook_command(path, cuda, monkeypatch)
    assert cmd[0] == sys.executable, f"{path.name}: runs {cmd[0]!r}, not the kernel's python (sys.executable)"
    script = Path(cmd[1]).resolve()
    assert script.parent == BENCHMARKS_DIR and script.suffix == ".py" and script.is_file(), \
        f"{path.name}: runs {cmd[1]!r}, not a script in {BENCHMARKS_DIR}"
    assert script.stem not in NOT_BENCHMARKS, f"{path.name}: runs {script.name}, which is not a benchmark"
    assert kwargs.get("check") is True, f"{path.name}: subprocess.run without check=True hides a failed run"
    args = parse_benchmark_args(script, cmd[2:], monkeypatch)
    device = "cuda" if cuda else "cpu"
    assert args.device == device, f"{path.name}: --device {args.device} where reprop.cuda_available() is {cuda}"
    assert args.quick, f"{path.name}: the notebook's run should be --quick"
    assert args.json is not None, f"{path.name}: no --json, but the notebook reads the results from it"
    out = namespace.get("out")
    assert out is not None and Path(args.json) == Path(out), \
        f"{path.name}: writes --json {args.json} but reads {out!r} (the notebook's `out`)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_shows_its_benchmarks_report(path, monkeypatch):
    """The report (the tables) is the benchmark's stdout: the run captures it as text, in a variable
    a code cell prints, so that the results cell shows it above the lines it reads from the JSON.
    Left to the subprocess, it goes wherever the kernel process's own stdout goes (the run cell's
    output or the Jupyter server's terminal, by kernel), mixed with the progress lines on stderr."""
    _, kwargs, namespace = notebook_command(path, False, monkeypatch)
    assert kwargs.get("stdout") == subprocess.PIPE and kwargs.get("text") is True, \
        f"{path.name}: subprocess.run does not capture the report (stdout=subprocess.PIPE, text=True)"
    kept = [name for name, value in namespace.items() if isinstance(value, subprocess.CompletedProcess)]
    assert kept, f"{path.name}: subprocess.run's result (the captured report) is not kept in a variable"
    shown = re.compile(rf"\bprint\(\s*({'|'.join(kept)})\.stdout\b")
    assert any(shown.search(src) for src in code_cells(load(path))), \
        f"{path.name}: no code cell prints the captured report ({' or '.join(kept)}.stdout)"


# An instruction to set DEVICE by hand; the code sets it from reprop.cuda_available() (checked above)
SET_DEVICE_BY_HAND = re.compile(r"\bset\s+`?DEVICE\b", re.IGNORECASE)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_markdown_does_not_ask_to_set_device_by_hand(path):
    for i, cell in enumerate(load(path)["cells"]):
        if cell["cell_type"] == "markdown":
            assert not SET_DEVICE_BY_HAND.search(source(cell)), \
                f"{path.name} cell {i}: tells the user to set DEVICE, which the code sets from reprop.cuda_available()"
