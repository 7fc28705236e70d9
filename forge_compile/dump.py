"""Graph dumps for debugging: FORGE_DUMP_DIR=dir (or dump_dir=) writes, per compiled graph,
<tag>.captured.py (as traced), <tag>.rewritten.py (after the FORGE pass, what Inductor gets) and
<tag>.report.txt."""
from __future__ import annotations

import itertools
import logging
import os

log = logging.getLogger(__name__)
_seq = itertools.count()


def dump_dir(explicit=None):
    return explicit or os.environ.get("FORGE_DUMP_DIR") or None


def write_dump(directory, tag, captured_code, rewritten_code, report):
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, f"{next(_seq):03d}_{tag}")
    for suffix, text in (("captured.py", captured_code), ("rewritten.py", rewritten_code),
                         ("report.txt", str(report))):
        with open(f"{stem}.{suffix}", "w") as f:
            f.write(text + "\n")
    log.info("forge: wrote graph dump %s.*", stem)
    return stem
