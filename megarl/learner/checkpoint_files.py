"""Is a learner checkpoint directory complete on disk? Checked from its own index, no tensor loaded.

A learner checkpoint (megarl.learner.dist_checkpoint) is megatron dist_checkpointing's
``torch_dist`` format: ``metadata.json`` (format and version), ``common.pt`` (the non-sharded
state, a torch zip archive), ``.metadata`` (torch.distributed.checkpoint's index: for every saved
item the shard file, offset and length) and the shard files ``__<rank>_<n>.distcp``; plus
megarl's ``megarl.json``. ``checkpoint_problems`` reads the index and checks that every shard file
it names exists and is long enough for every item it holds, and that the small files parse. A
shard cut short (a full disk, a copy or a node that died mid-write) is found here instead of as an
``EOFError`` deep inside the load.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

INDEX_FILE = ".metadata"
FORMAT_FILE = "metadata.json"
COMMON_FILE = "common.pt"


def torch_archive_problem(path: Path) -> str | None:
    """Why the ``torch.save`` archive ``path`` is unreadable (a zip whose every member must pass
    its CRC check), or None when it is whole."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return f"{path}: unreadable ({e})"
    return None if bad is None else f"{path}: member {bad} is corrupt"


def _index_problems(ckpt_dir: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        index = FileSystemReader(str(ckpt_dir)).read_metadata()
    except Exception as e:  # a cut pickle raises anything from EOFError to UnpicklingError
        return [f"{ckpt_dir / INDEX_FILE}: unreadable ({type(e).__name__}: {e})"]
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        path = ckpt_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size < end:
            problems.append(f"{path}: {path.stat().st_size} bytes, the index needs at least {end}")
    return problems


def checkpoint_problems(ckpt_dir: str | os.PathLike, meta_file: str = "megarl.json") -> list[str]:
    """What is missing or cut short in the learner checkpoint ``ckpt_dir`` ([] when it is complete);
    each entry names the file."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return [f"{d}: missing"]
    problems = []
    for name in (meta_file, FORMAT_FILE):
        try:
            json.loads((d / name).read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{d / name}: unreadable ({e})")
    if (d / INDEX_FILE).exists() or not problems:
        problems += _index_problems(d)
    problem = torch_archive_problem(d / COMMON_FILE)  # dist_checkpointing always writes it
    return problems + ([problem] if problem else [])
