"""Folders of user images, as ``tools/infer.py`` reads them: which files, how each is decoded, where its outputs go.

Every file is decoded here, before the model sees it, so that one that is not a readable image (a truncated JPEG,
a text file named ``.jpg``, an empty file) is skipped with its reason instead of ending the run. Images are decoded
as mmdet's ``LoadImageFromFile`` decodes them with its defaults (OpenCV, ``color``), which every config of this
repository uses: 3-channel 8-bit BGR, grayscale repeated over the channels, 16-bit images scaled to 8 bits by
OpenCV (the top 8 bits: 65535 -> 255), the alpha channel dropped, EXIF orientation applied.

Output names keep each image's path relative to the folder the inputs share, so that ``a/x.jpg`` and ``b/x.jpg``
write ``vis/a/x.jpg`` and ``vis/b/x.jpg`` instead of one over the other.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import List, Sequence, Tuple

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
JPEG_START = b"\xff\xd8"
# Markers that stand alone, with no length field after them: restarts RST0-RST7 and TEM.
_MARKERS_WITHOUT_LENGTH = set(range(0xD0, 0xD8)) | {0x01}
_END_OF_IMAGE = 0xD9
_START_OF_SCAN = 0xDA


class UnreadableImage(Exception):
    """A file that cannot be read as an image; the message says why."""


@dataclass(frozen=True)
class ImageFile:
    """An image to run: its path as found, and its name under the output folders (unique within a run)."""

    path: str
    name: str


def find_images(paths: Sequence[str], recursive: bool = False) -> Tuple[List[ImageFile], int]:
    """The images that ``paths`` (files and folders) name, and how many other files the folders hold.

    A folder contributes its files with an image suffix (any case), sorted, and with ``recursive`` those of its
    subfolders; a file named directly is taken whatever its suffix. A file reached twice is taken once.
    """
    found, seen, ignored = [], set(), 0
    for path in paths:
        if os.path.isdir(path):
            files, others = _folder_images(path, recursive)
            ignored += others
        else:
            files = [path]
        for file in files:
            key = os.path.realpath(file)
            if key not in seen:
                seen.add(key)
                found.append(file)
    if not found:
        return [], ignored
    absolute = [os.path.abspath(file) for file in found]
    root = os.path.commonpath([os.path.dirname(file) for file in absolute])
    return [ImageFile(file, os.path.relpath(full, root)) for file, full in zip(found, absolute)], ignored


def _folder_images(folder: str, recursive: bool) -> Tuple[List[str], int]:
    images, others = [], 0
    for current, subfolders, names in os.walk(folder):
        subfolders.sort()
        for name in sorted(names):
            if name.lower().endswith(IMAGE_SUFFIXES):
                images.append(os.path.join(current, name))
            else:
                others += 1
        if not recursive:
            break
    return images, others


def has_subfolders(paths: Sequence[str]) -> bool:
    return any(os.path.isdir(path) and any(entry.is_dir() for entry in os.scandir(path)) for path in paths)


def prediction_names(names: Sequence[str]) -> List[str]:
    """The ``.json`` name of each image's predictions: ``x.json`` for ``x.jpg`` as mmdet writes it, ``x.jpg.json``
    where another image of the same folder shares the stem (``x.png``), so that no two names are equal."""
    stems = [os.path.splitext(name)[0] for name in names]
    counts = Counter(stems)
    json_names = [f"{stem}.json" if counts[stem] == 1 else f"{name}.json" for stem, name in zip(stems, names)]
    if len(set(json_names)) != len(json_names):  # a stem that is another image's full name: 'x.png' and 'x.png.jpg'
        json_names = [f"{name}.json" for name in names]
    return json_names


def read_image(path: str):
    """The image at ``path`` as a ``(H, W, 3)`` uint8 BGR array, as mmdet's ``LoadImageFromFile`` decodes it.

    Raises :class:`UnreadableImage` with the reason where the file cannot be read or is not a complete image.
    """
    import mmcv

    try:
        with open(path, "rb") as handle:
            content = handle.read()
    except OSError as error:
        raise UnreadableImage(f"cannot be read: {error.strerror}") from None
    if not content:
        raise UnreadableImage("empty file")
    if content.startswith(JPEG_START) and not jpeg_is_complete(content):
        # Some OpenCV releases decode the part that is there and fill the rest with grey.
        raise UnreadableImage("truncated JPEG: the data ends before the image does")
    try:
        image = mmcv.imfrombytes(content, flag="color", backend="cv2")
    except Exception:  # OpenCV raises cv2.error on some malformed inputs, returns None on others
        image = None
    if image is None:
        raise UnreadableImage("not an image that OpenCV can decode" + (" (it is text)" if _is_text(content) else ""))
    return image


def jpeg_is_complete(content: bytes) -> bool:
    """Whether a JPEG's segments run from its start to its end-of-image marker before the data ends.

    Walks the markers: each segment's length skips its payload; after a start-of-scan, the entropy-coded data runs
    to the next 0xFF that is neither a stuffed 0x00 nor a restart marker. Bytes after the end-of-image marker
    (camera trailers, appended videos) are not read.
    """
    size = len(content)
    position = len(JPEG_START)
    while True:
        position = content.find(b"\xff", position)
        if position < 0 or position + 1 >= size:
            return False
        marker = content[position + 1]
        if marker == 0xFF:  # a fill byte before the marker
            position += 1
        elif marker == _END_OF_IMAGE:
            return True
        elif marker in _MARKERS_WITHOUT_LENGTH or marker == 0x00:
            position += 2
        else:
            if position + 4 > size:
                return False
            position += 2 + int.from_bytes(content[position + 2:position + 4], "big")
            if marker == _START_OF_SCAN:
                position = _end_of_entropy_coded_data(content, position)
                if position < 0:
                    return False


def _end_of_entropy_coded_data(content: bytes, position: int) -> int:
    """The position of the marker that ends the scan starting at ``position``, or -1 where the data ends first."""
    size = len(content)
    while True:
        position = content.find(b"\xff", position)
        if position < 0 or position + 1 >= size:
            return -1
        following = content[position + 1]
        if following == 0x00 or 0xD0 <= following <= 0xD7:  # stuffing, or a restart inside the scan
            position += 2
        elif following == 0xFF:
            position += 1
        else:
            return position


def _is_text(content: bytes) -> bool:
    head = content[:512]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(character.isprintable() or character.isspace() for character in text)
