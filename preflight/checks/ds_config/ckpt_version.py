"""Host side: the DeepSpeed version a checkpoint was saved with, read from its model states file without loading
it. DeepSpeed puts ``ds_version`` in every model states dict it saves (runtime/engine.py:5038,
``_common_checkpoint_state``; the ZeRO optimizer states too, :5551), and torch.save writes a zip whose
``<name>/data.pkl`` is the pickled dict, e.g.::

    global_step1000/mp_rank_00_model_states.pt -> zip member mp_rank_00_model_states/data.pkl
    ... \\x8c\\nds_version\\x94\\x8c\\x060.19.8\\x94 ...                -> "0.19.8"

The pickle is never unpickled (a host's file is data, and unpickling runs code): pickletools.genops only decodes
its opcodes, starting at the key, and the first string after it is the value.
"""
from __future__ import annotations

import io
import pickletools
import re
import zipfile
from typing import Optional

KEY = b"ds_version"
PICKLE_MAX = 64 << 20  # bytes of data.pkl read: the tensors live in other members, the dict's pickle is small
_VERSION = re.compile(r"\d+\.\d+(?:\.\d+)?[\w.+-]{0,40}")
_MEMO = ("BINPUT", "LONG_BINPUT", "MEMOIZE", "PUT")
_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING")


def version_after_key(data: bytes) -> Optional[str]:
    """The string value that follows the pickled key ``ds_version`` (a dict's SETITEMS lists key, value), or None."""
    start = 0
    while True:
        at = data.find(KEY, start)
        if at < 0:
            return None
        start = at + len(KEY)
        try:
            for op, arg, _ in pickletools.genops(io.BytesIO(data[start:start + 256])):
                if op.name in _MEMO:
                    continue
                if op.name in _STRINGS:
                    text = arg.decode("utf-8", "replace") if isinstance(arg, bytes) else str(arg)
                    if _VERSION.fullmatch(text):
                        return text
                break
        except Exception:  # noqa: BLE001 - a truncated slice ends the walk; this occurrence tells nothing
            continue


def saved_version(path: str) -> Optional[str]:
    """``ds_version`` of a torch.save'd DeepSpeed states file (zip format, torch >= 1.6's default), or None: not
    such a file, no version in it, or unreadable."""
    try:
        with zipfile.ZipFile(path) as archive:
            member = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if member is None:
                return None
            with archive.open(member) as fh:
                return version_after_key(fh.read(PICKLE_MAX))
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return None


def _major_minor(version: str) -> Optional[tuple]:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def mismatch(saved: Optional[str], hosts: dict, where: str) -> Optional[tuple]:
    """(message, fix) when the checkpoint at ``where`` was saved with another DeepSpeed major or minor version than
    a host runs ({host: version}); None when they agree, or either is unknown. A patch release keeps the format."""
    mine = _major_minor(saved or "")
    if mine is None:
        return None
    other = {h: str(v) for h, v in sorted(hosts.items())  # a host's word: only a version-shaped one is shown
             if isinstance(v, str) and _VERSION.fullmatch(v) and _major_minor(v) != mine}
    if not other:
        return None
    versions = sorted(set(other.values()))
    names = ", ".join(other)
    return (f"the checkpoint {where} was saved with DeepSpeed {saved}, but {names} run{'s' if len(other) == 1 else ''} "
            f"DeepSpeed {', '.join(versions)}: another minor version may not load it (ZeRO reads its optimizer states "
            f"by the saved ds_version, runtime/zero/stage_1_and_2.py:3677-3686; a universal checkpoint is the "
            f"portable form)",
            f"resume with the version it was saved with (deepspeed=={saved} in the job's Python on every host), or "
            f"load it once with DeepSpeed {versions[0]} before the job")
