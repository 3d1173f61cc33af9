"""gateway/log.py: the gateway and its engine workers write one shared stream (stderr, journald, or
`logging.file`), so every event must reach it as one whole line, whatever the other processes write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WRITER = """
import sys
from gateway.log import configure_logging
import structlog
configure_logging("info")  # stderr: the serve's and its workers' shared stream
log = structlog.get_logger("writer")
for i in range(int(sys.argv[3])):
    log.info("line", writer=sys.argv[2], i=i, pad="x" * (i % 97))
"""


def test_processes_sharing_one_unbuffered_stderr_write_whole_json_lines(tmp_path: Path) -> None:
    """Four processes log 3,000 events each to one shared stderr (a file, as a supervised serve's workers
    inherit it) at once, unbuffered (PYTHONUNBUFFERED): every line is one JSON event, none lost or torn."""
    path, per_writer = tmp_path / "shared.log", 3000
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    with path.open("ab") as shared:
        writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), f"w{n}", str(per_writer)], env=env,
                                    stderr=shared) for n in range(4)]
        assert [w.wait(timeout=120) for w in writers] == [0, 0, 0, 0]
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(events) == 4 * per_writer
    for n in range(4):
        assert sorted(e["i"] for e in events if e["writer"] == f"w{n}") == list(range(per_writer))
