"""The `sdiree` command line itself: usage errors, --version, --help, and the compile-extra hint.

Each runs `python3 -m sdiree.runtime.cli` in a subprocess, as a user would, except where a
parsed value is checked directly.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version

import pytest

from sdiree.runtime import __version__, cli, schedulers
from sdiree.runtime.cli_parser import build_parser
from sdiree.runtime.errors import UserError


def sdiree(*args, code: str | None = None):
    """Run the CLI with args; with `code`, run that Python first in the same process."""
    run = ["-m", "sdiree.runtime.cli"]
    if code is not None:
        run = ["-c", code + "\nfrom sdiree.runtime.cli import main\nmain()"]
    cmd = [sys.executable, *run, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def error_line(proc) -> str:
    """The one line a failure prints: non-zero exit, no traceback, `error: ...` alone."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0] != "error: ", lines
    return lines[0]


def test_no_arguments_prints_usage_and_exits_2():
    proc = sdiree()
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: sdiree")
    for command in ("compile", "run", "devices", "bench"):
        assert command in proc.stderr
    assert "error" not in proc.stderr and "Traceback" not in proc.stderr


def test_version():
    proc = sdiree("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"sdiree {__version__}" == f"sdiree {version('sdiree')}"


def test_run_help_lists_schedulers():
    proc = sdiree("run", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps help text
    for name in schedulers.NAMES:
        assert name in text
    assert " ".join(schedulers.choices_help().split()) in text  # with the aliases each takes


@pytest.mark.parametrize(
    "args,says",
    [
        (["run", "somewhere"], "required: --prompt"),
        (["run", "--prompt", "a"], "required: ARTIFACT_DIR"),
        (["run", "x", "--prompt", "a", "--steps", "abc"], "--steps: invalid int value: 'abc'"),
        (["run", "x", "--prompt", "a", "--guidance-scale", "lots"], "invalid float value"),
        (["run", "x", "--prompt", "a", "--no-such-option"], "unrecognized arguments"),
        (["run", "x", "--prompt", "a", "--prom", "b"], "unrecognized arguments: --prom"),
        (["compile", "m"], "required: --target"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["--no-such-option"], "unrecognized arguments"),
    ],
)
def test_usage_errors_are_one_line(args, says):
    proc = sdiree(*args)
    line = error_line(proc)
    assert proc.returncode == 2
    assert says in line
    command = args[0] if args[0] in ("run", "compile") else None
    assert f"see `sdiree {command} --help`" in line if command else "see `sdiree --help`" in line


@pytest.mark.parametrize("seed", [-1, 0, 2**32, 2**64 - 1, 2**70])
def test_seed_parses_any_int(seed):
    args = build_parser().parse_args(["run", "x", "--prompt", "a", "--seed", str(seed)])
    assert args.seed == seed


def test_negative_seed_reaches_the_command(tmp_path):
    # parsed as the seed, not as an unknown option: the error is about the missing artifact
    line = error_line(sdiree("run", tmp_path / "none", "-p", "a", "--seed", "-1"))
    assert "none" in line and "unrecognized" not in line


HIDE_TORCH = "import sys\nsys.modules['torch'] = None  # as if not installed"


@pytest.mark.parametrize("command", ["compile", "bench"])
def test_missing_torch_gives_install_hint(command, tmp_path):
    line = error_line(sdiree(command, tmp_path, "--target", "cpu", code=HIDE_TORCH))
    assert "pip install 'sdiree[compile]'" in line
    assert "(from a source checkout: pip install -e '.[compile]')" in line
    assert "missing: torch" in line


def test_missing_package_metadata_gives_install_hint(tiny_model, tmp_path):
    # torch imports but has no distribution metadata: compile looks its version up at build time
    hide_metadata = textwrap.dedent(
        """
        import importlib.metadata as md
        real = md.version
        def version(name):
            if name == "torch":
                raise md.PackageNotFoundError(name)
            return real(name)
        md.version = version
        """
    )
    out = tmp_path / "out"
    line = error_line(
        sdiree("compile", tiny_model, "--target", "cpu", "--out", out, code=hide_metadata)
    )
    assert "pip install 'sdiree[compile]'" in line and "torch" in line
    assert not (out / "manifest.json").exists()


def test_import_error_inside_sdiree_is_not_called_a_missing_extra():
    own = ImportError("cannot import name 'X' from 'sdiree.runtime.manifest'")
    own.name = "sdiree.runtime.manifest"
    message = str(cli._compile_side_error("compile", own))
    assert "sdiree's own module sdiree.runtime.manifest" in message and "reinstall" in message
    assert "needs the compile extra" not in message
    theirs = str(cli._compile_side_error("bench", ModuleNotFoundError("x", name="diffusers")))
    assert theirs.startswith("sdiree bench needs the compile extra")


def test_errors_raised_while_compiling_give_the_hint():
    def compile_model(options):
        raise PackageNotFoundError("iree-turbine")

    with pytest.raises(UserError, match=r"needs the compile extra .*iree-turbine.*-e '\.\[compile"):
        cli._call_compile_side("compile", compile_model, None)
