"""Package the assembled tree as a wheel of the forked engine.

The wheel is upstream's wheel with our package contents: the same tag, the same metadata
(dependencies, entry points, license) with the fork's version, and upstream's compiled
``.so`` files carried byte for byte (they cannot be rebuilt from the wheel).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import zipfile
from pathlib import Path

from .git import git
from .tree import PKG

_EPOCH = (1980, 1, 1, 0, 0, 0)


def _record_hash(data: bytes) -> str:
    digest = (
        base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    )
    return f"sha256={digest}"


def build_wheel(
    tree: Path, upstream_wheel: Path, upstream_version: str, version: str, out_dir: Path
) -> Path:
    tag = upstream_wheel.name.split("-", 2)[2].removesuffix(".whl")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"sglang-{version}-{tag}.whl"
    tmp = target.with_suffix(".part")
    old_info = f"sglang-{upstream_version}.dist-info/"
    new_info = f"sglang-{version}.dist-info/"
    files = git(tree, "ls-files", "-s", "--", PKG).stdout.splitlines()
    record = []
    with zipfile.ZipFile(upstream_wheel) as up, zipfile.ZipFile(
        tmp, "w", compression=zipfile.ZIP_DEFLATED
    ) as zf:

        def add(name: str, data: bytes, mode: int = 0o644) -> None:
            info = zipfile.ZipInfo(name, _EPOCH)
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
            record.append((name, _record_hash(data), str(len(data))))

        for line in files:
            meta, path = line.split("\t", 1)
            mode = 0o755 if meta.startswith("100755") else 0o644
            add(path.removeprefix("python/"), (tree / path).read_bytes(), mode)
        for info in up.infolist():
            if not info.filename.startswith(old_info) or info.is_dir():
                continue
            name = new_info + info.filename.removeprefix(old_info)
            if name.endswith("/RECORD"):
                continue
            data = up.read(info)
            if name.endswith("/METADATA"):
                data = re.sub(
                    rb"(?m)^Version: .*$", f"Version: {version}".encode(), data, count=1
                )
            add(name, data)
        record.append((f"{new_info}RECORD", "", ""))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(record)
        info = zipfile.ZipInfo(f"{new_info}RECORD", _EPOCH)
        info.external_attr = 0o100644 << 16
        zf.writestr(info, text.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(target)
    return target
