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
