"""Fetches libc10.so and libc10_cuda.so from PyTorch's x86-64 wheels on PyPI without the rest of
the wheel (about 2 MB of a 530 MB file), with PyTorch's own memory snapshot tools
(torch/cuda/_memory_viz.py, and the viewer torch/utils/viz/MemoryViz.js where the wheel ships it):
HTTP range requests read the zip's central directory, then each file's entry. Each file is
checked against the CRC the wheel lists.

    torch_libs.py VERSION OUT_DIR

The tests probe these real libraries (c10::Error's constructor, where OutOfMemoryError is built)
without a GPU and without installing torch.
"""

import json
import os
import struct
import sys
import urllib.parse
import urllib.request
import zlib

WANTED = ("torch/lib/libc10.so", "torch/lib/libc10_cuda.so", "torch/cuda/_memory_viz.py")
# Fetched where the wheel has it.
OPTIONAL = ("torch/utils/viz/MemoryViz.js",)


INDEX = "https://pypi.org/pypi/torch/json"


def wheel_url(version):
    with urllib.request.urlopen(INDEX, timeout=60) as r:
        files = json.load(r)["releases"].get(version, [])
    for f in files:
        name = f["filename"]
        if name.endswith("manylinux_2_28_x86_64.whl") and "-cp312-" in name:
            # Absolute on pypi.org; a mirror may answer relative to the index.
            return urllib.parse.urljoin(INDEX, f["url"])
    raise SystemExit(f"torch {version}: no cp312 x86-64 wheel on PyPI")


def ranged(url, start, end):
    req = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def zip64(extra, fields):
    """The sizes and offset a Zip64 extra field gives for those the header left at 0xffffffff."""
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            values, k = list(fields), at + 4
            for i, v in enumerate(values):
                if v == 0xFFFFFFFF:
                    values[i] = struct.unpack_from("<Q", extra, k)[0]
                    k += 8
            return values
        at += 4 + size
    return list(fields)


def fetch(version, out):
    url = wheel_url(version)
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
        size = int(r.headers["Content-Length"])
    tail = ranged(url, max(0, size - 65558), size - 1)
    eocd = tail.rfind(b"PK\x05\x06")
    entries, cd_size, cd_offset = struct.unpack_from("<HII", tail, eocd + 10)
    if cd_offset == 0xFFFFFFFF:
        z = tail.rfind(b"PK\x06\x06")
        cd_size, cd_offset = struct.unpack_from("<QQ", tail, z + 40)
    cd = ranged(url, cd_offset, cd_offset + cd_size - 1)
    at, found = 0, 0
    os.makedirs(out, exist_ok=True)
    while at < len(cd):
        (method, crc, csize, usize, name_len, extra_len, comment_len, offset) = (
            struct.unpack_from("<H", cd, at + 10)[0], *struct.unpack_from("<III", cd, at + 16),
            *struct.unpack_from("<HHH", cd, at + 28), struct.unpack_from("<I", cd, at + 42)[0])
        name = cd[at + 46:at + 46 + name_len].decode()
        extra = cd[at + 46 + name_len:at + 46 + name_len + extra_len]
        at += 46 + name_len + extra_len + comment_len
        if name not in WANTED + OPTIONAL:
            continue
        usize, csize, offset = zip64(extra, (usize, csize, offset))
        local = ranged(url, offset, offset + 29)
        skip = 30 + sum(struct.unpack_from("<HH", local, 26))
        data = ranged(url, offset + skip, offset + skip + csize - 1)
        if method == 8:
            data = zlib.decompress(data, -15)
        if len(data) != usize or zlib.crc32(data) != crc:
            raise SystemExit(f"torch {version}: {name} does not match the wheel's CRC")
        with open(os.path.join(out, os.path.basename(name)), "wb") as f:
            f.write(data)
        found += name in WANTED
    if found != len(WANTED):
        raise SystemExit(f"torch {version}: found {found} of {WANTED} in the wheel")


if __name__ == "__main__":
    fetch(sys.argv[1], sys.argv[2])
