"""Atomic JSON writes (artifact.json, checkpoints' state): a reader never sees a torn file while a writer
rewrites it, and a writer killed at any moment leaves the previous complete file or the new one."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

WRITER = """
import sys
from pathlib import Path
from align.artifacts import write_json_atomic
path, i = Path(sys.argv[1]), 0
print("ready", flush=True)
while True:  # ~2 MB versions, each readable as a whole
    write_json_atomic(path, {"version": i, "payload": [i] * 250_000})
    i += 1
"""


def killed_mid_write(path: Path, writer: str, whole) -> None:
    """Start `writer` (Python code that prints "ready", then rewrites `path` (argv[1]) with version after version)
    and SIGKILL it at three moments: every read of `path` while it writes, and what it leaves, is one whole
    version (`whole(text)` asserts that), and at most its temp file is left beside it."""
    for delay in (0.1, 0.3, 0.6):
        proc = subprocess.Popen([sys.executable, "-c", writer, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        reads, end, give_up = 0, time.time() + delay, time.time() + 60
        # read while it writes, every read one whole version; at least 4 reads each time (a loaded machine)
        while time.time() < end or reads < 4:
            assert time.time() < give_up, f"{path}: nothing written in 60 s"
            if path.exists():
                whole(path.read_text())
                reads += 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        whole(path.read_text())
    leftovers = [p.name for p in path.parent.iterdir() if p != path]
    assert all(".tmp" in n for n in leftovers)  # a killed writer leaves at most its own temp file beside it


def test_a_writer_killed_mid_write_never_leaves_a_torn_file(tmp_path):
    def whole(text):
        obj = json.loads(text)
        assert obj["payload"] == [obj["version"]] * 250_000

    killed_mid_write(tmp_path / "artifact.json", WRITER, whole)


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path):
    """atomic_open (under write_json_atomic, tasks.write_jsonl and the pipeline's files): an error in the middle of
    the writing leaves the previous file as it was and removes the temporary one; a new file's folder is made."""
    import pytest

    from align.artifacts import atomic_open, write_text_atomic
    from align.tasks import write_jsonl

    path = tmp_path / "a" / "data.jsonl"
    write_jsonl([{"x": 1}, {"x": 2}], path)
    assert path.read_text() == '{"x": 1}\n{"x": 2}\n'

    def rows():
        yield {"x": 3}
        raise RuntimeError("the generator broke")

    with pytest.raises(RuntimeError):
        write_jsonl(rows(), path)
    with pytest.raises(ZeroDivisionError), atomic_open(path) as f:
        f.write("half")
        1 / 0
    assert path.read_text() == '{"x": 1}\n{"x": 2}\n' and sorted(p.name for p in path.parent.iterdir()) == [
        "data.jsonl"]
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and len(list(path.parent.iterdir())) == 1


def test_git_commit_says_when_the_code_differs_from_its_commit(tmp_path):
    """artifact.json's git_commit: the checkout's HEAD, "-dirty" when a tracked file was edited since (an artifact
    made by uncommitted code says so), None outside a git checkout."""
    from align.artifacts import git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    assert git_commit(tmp_path) is None
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "a")
    sha = git_commit(tmp_path)
    assert sha and len(sha) == 40 and "dirty" not in sha
    (tmp_path / "untracked.txt").write_text("not tracked: not dirty\n")
    assert git_commit(tmp_path) == sha
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == sha + "-dirty"
