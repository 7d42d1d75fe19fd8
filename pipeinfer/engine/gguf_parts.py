"""Split GGUFs: llama.cpp's gguf-split sets, NAME-00001-of-0000N.gguf.

Models past ~50 GB ship as N files. Each part is a GGUF of its own carrying the keys `split.no` (0-based),
`split.count` and `split.tensors.count` (gguf.Keys.Split); the first part holds every other key-value, and the
tensors are spread over the parts in order. llama.cpp loads a set from its first part's path (the other names
follow from it: llama_split_prefix, llama_split_path in src/llama.cpp), and pipeinfer does the same: a set is named
by its first part, its size is the sum of its parts, ggufheader.read_header sees every part's tensors (each
TensorInfo names the file holding its data) and ggufheader.model_files gives the validated list of parts; what
pipeinfer writes from a set (a stage file, a pruned head, a file that travels) is one GGUF without the split keys.

This module says what a set is from names and split keys (pure but for looking whether the parts exist); reading
headers is ggufheader.py's.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import UserError

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"  # gguf.Keys.Split's
SPLIT_KEYS = frozenset({SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS})
SHARD_NAME_FORMAT = "{:s}-{:05d}-of-{:05d}.gguf"  # gguf-py's (gguf_writer.py) and llama.cpp's, 1-based
_PART = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5,})-of-(?P<count>\d{5,})\.gguf$")


class SplitSetError(UserError, ValueError):
    """A split GGUF that cannot be read as given: one line naming the file to pass or the part that is missing."""


@dataclass(frozen=True)
class PartName:
    """What a part's name says: NAME-0000k-of-0000n.gguf."""
    prefix: str   # the path less "-0000k-of-0000n.gguf"
    no: int       # 1-based, as in the name
    count: int

    def path(self, no: int) -> str:
        return SHARD_NAME_FORMAT.format(self.prefix, no, self.count)


def part_name(path: str | os.PathLike) -> PartName | None:
    """The part a file's name says it is, or None for a name of another form."""
    m = _PART.match(os.fspath(path))
    if m is None or not 1 <= int(m["no"]) <= int(m["count"]):
        return None
    return PartName(m["prefix"], int(m["no"]), int(m["count"]))


def set_stem(path: str | os.PathLike) -> str:
    """The name a model's derived files take: NAME for NAME-00001-of-0000N.gguf, else the file's stem."""
    name = part_name(Path(path).name)
    return name.prefix if name is not None else Path(path).stem


def is_split(split_no, split_count) -> bool:
    """Whether a file's split keys (None where absent) make it part of a set."""
    return split_no not in (None, 0) or int(split_count or 1) > 1


def part_paths(path: str | os.PathLike, split_no, split_count) -> tuple[str, ...]:
    """The files of the model whose file is `path`, in order, from that file's split.no and split.count (None where
    absent): (path,) for a single GGUF. SplitSetError when path is a later part (pass the first), when its name does
    not say where the other parts are, or when a part is missing."""
    path = os.fspath(path)
    count = int(split_count or 1)
    name = part_name(path)
    if split_no not in (None, 0):
        first = f"its first part, {Path(name.path(1)).name}" if name is not None else "the set's first part"
        raise SplitSetError(f"{path} is part {int(split_no) + 1} of {count} of a split GGUF: pass {first} "
                            f"(llama.cpp and pipeinfer find the other parts from it)")
    if count <= 1:
        return (path,)
    if name is None or name.no != 1 or name.count != count:
        raise SplitSetError(f"{path} is the first part of a {count}-part split GGUF, but its name does not end in "
                            f"-00001-of-{count:05d}.gguf, from which the other parts are found: rename the parts "
                            f"as gguf-split wrote them")
    paths = tuple(name.path(i) for i in range(1, count + 1))
    for i, p in enumerate(paths, 1):
        if not os.path.isfile(p):
            raise SplitSetError(f"split GGUF {Path(name.prefix).name}: part {i} of {count}, {p}, is missing")
    return paths


def check_part(path: str, index: int, count: int, split_no, split_count) -> None:
    """Part `index` (0-based) of a `count`-part set says so in its own split keys."""
    if split_no is None or split_count is None:
        raise SplitSetError(f"{path}: not a part of a split GGUF (no split keys), though the first part names it "
                            f"part {index + 1} of {count}")
    if (int(split_no), int(split_count)) != (index, count):
        raise SplitSetError(f"{path}: its split keys say part {int(split_no) + 1} of {int(split_count)}, not "
                            f"{index + 1} of {count} (parts of different sets?)")


def check_tensor_count(path: str, found: int, expected) -> None:
    """The parts hold the tensors the first part's split.tensors.count announces (none lost, none twice)."""
    if expected is not None and found != int(expected):
        raise SplitSetError(f"split GGUF {path}: its parts hold {found} tensors, the first part announces "
                            f"{int(expected)} (parts of different sets?)")
