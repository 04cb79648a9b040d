"""The runtime never imports torch, diffusers, transformers, iree.compiler or iree.turbine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent(
    """
    import sys
    BANNED = ("torch", "diffusers", "transformers", "iree.compiler", "iree.turbine", "sdiree.compile")

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BANNED):
                raise ImportError(f"torch-free runtime imported {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    sys.argv = ["sdiree", *sys.argv[1:]]
    from sdiree.runtime.cli import main
    main()
    """
)


def run_blocked(*args):
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_help_and_devices_without_torch():
    assert run_blocked("--help").returncode == 0
    proc = run_blocked("devices")
    assert proc.returncode == 0, proc.stderr
    assert "local-task" in proc.stdout


def test_run_without_torch(compiled, tmp_path):
    for target, arch in (("cpu", "host"), ("vulkan-spirv", "lavapipe")):
        art = compiled.get(target, arch, "fp32")
        out = tmp_path / f"{target}.png"
        proc = run_blocked(
            "run", art, "--prompt", "a lighthouse", "--steps", 2, "--seed", 1, "-o", out
        )
        assert proc.returncode == 0, proc.stderr
        assert out.is_file()


def test_compile_without_extra_says_how_to_install():
    proc = run_blocked("compile", "somewhere", "--target", "cpu")
    assert proc.returncode != 0
    assert "pip install 'sdiree[compile]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_blocker_really_blocks():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKER.replace("from sdiree.runtime.cli import main\nmain()", "import torch"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "torch-free runtime imported torch" in proc.stderr
