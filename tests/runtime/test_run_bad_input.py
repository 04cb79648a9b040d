"""`sdiree run` on bad input from the command line: one `error:` line, a non-zero exit, no
traceback and no output file, for each row of a table; plus the failures of writing the PNG
(a full disk, a file created by another run meanwhile)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from sdiree.runtime.errors import UserError

MAX_SEED = 2**64 - 1


def sdiree(*args):
    # str arguments are encoded with os.fsencode: "\udcff" reaches the CLI as the byte 0xff,
    # as a prompt typed in a Latin-1 terminal does.
    return subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", *map(str, args)],
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=600,
    )


def assert_one_error_line(proc, must_say):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert must_say in lines[0], lines[0]


@pytest.fixture(scope="module")
def cpu_art(compiled):
    return compiled.get("cpu", "host", "fp32")


# (arguments after the artifact, what the one line must say); "--prompt a" unless given.
BAD = [
    (["--seed", 2**64], f"--seed {2**64}: the seed must be in 0..2**64-1, or -1 for a random"),
    (["--seed", 10**30], "the seed must be in 0..2**64-1"),
    (["--seed", -2], "--seed -2: the seed must be in 0..2**64-1, or -1"),
    (["--seed", MAX_SEED, "--num-images", 2], f"choose a seed of at most {MAX_SEED - 1}"),
    (["--prompt", "caf\udcff"], "--prompt is not valid UTF-8 text (byte 0xff at character 3)"),
    (
        ["--negative-prompt", "\udce9t\udce9"],
        "--negative-prompt is not valid UTF-8 text (byte 0xe9",
    ),
    (["--num-images", 0], "at least 1"),
    (["--steps", 0], "at least 1"),
    (["--height", 0], "--height 0 is not a positive multiple of 8"),
    (["--width", 12], "--width 12 is not a positive multiple of 8"),
    (["--width", 128], "this artifact was compiled for 64x64"),
    (
        ["--width", 64, "--height", 48],
        "64x48 px: this artifact was compiled for 64x64; recompile with --sizes 64x48",
    ),
    (["--vae-memory", 0], "--vae-memory 0: give the MiB one VAE call may take"),
    (["--vae-memory", 1], "memory budget 1 MiB is below the ~"),
    (["-o", "{tmp}/o.jpg"], "must end in .png"),
    (["-o", "{tmp}/missing/o.png"], "does not exist; create it or choose another -o"),
    (["-o", "{tmp}/exists.png"], "exists.png exists; pass --overwrite to replace it"),
]


@pytest.mark.parametrize("extra,must_say", BAD, ids=[" ".join(map(str, b[0])) for b in BAD])
def test_bad_run_input_is_one_line(cpu_art, tmp_path, extra, must_say):
    (tmp_path / "exists.png").write_bytes(b"old")
    before = sorted(p.name for p in tmp_path.iterdir())
    extra = [str(a).format(tmp=tmp_path) for a in extra]
    args = ["--prompt", "a", "--steps", 1, "-o", tmp_path / "o.png", *extra]
    assert_one_error_line(sdiree("run", cpu_art, *args), must_say)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "exists.png").read_bytes() == b"old"


@pytest.mark.parametrize("prompt", ["caf\udcff", "\udcc3"])
def test_undecodable_prompt_fails_before_reading_the_artifact(tmp_path, prompt):
    # The text check is the first: it needs no artifact (this one does not exist).
    proc = sdiree("run", tmp_path / "nope", "--prompt", prompt)
    assert_one_error_line(proc, "--prompt is not valid UTF-8")


@contextlib.contextmanager
def full_tmpfs(where: Path):
    """A one-page tmpfs at `where`, filled up; skips the test where mounting is not allowed."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(where)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with contextlib.suppress(OSError), open(where / "filler", "wb") as f:
            f.write(b"x" * 65536)
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_full_disk_is_one_line_and_leaves_no_temp(cpu_art, tmp_path):
    with full_tmpfs(tmp_path / "full") as full:
        proc = sdiree("run", cpu_art, "--prompt", "a", "--steps", 1, "--seed", 1,
                      "-o", full / "o.png")  # fmt: skip
        # Found only when writing, after the progress lines: the last line is the one error.
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        assert [ln for ln in lines if ln.startswith("error: ")] == lines[-1:], proc.stderr
        assert "No space left on device; free some space or choose another -o" in lines[-1]
        assert sorted(p.name for p in full.iterdir()) == ["filler"]


def test_file_created_meanwhile_is_not_overwritten(cpu_art, tmp_path, monkeypatch):
    """Two runs writing the same -o: the one that finishes second must not replace the other's
    file. Here the other run's file appears between the existence check and the rename."""
    from sdiree.runtime import generate, image_output

    out = tmp_path / "o.png"
    real_write = image_output._write_png

    def racing_write(tmp, *args):
        real_write(tmp, *args)
        out.write_bytes(b"the other run's image")

    monkeypatch.setattr(image_output, "_write_png", racing_write)
    with pytest.raises(UserError, match="created by another process") as e:
        generate.generate_to_files(artifact_dir=cpu_art, prompt="a", steps=1, seed=1, output=out)
    assert "\n" not in str(e.value)
    assert out.read_bytes() == b"the other run's image"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.png"]
