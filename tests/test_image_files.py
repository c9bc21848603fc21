"""Reading folders of user images (deform_plugin.image_files): which files, how each decodes, unique output names."""
from __future__ import annotations

import cv2
import numpy as np
import pytest

from deform_plugin.image_files import (UnreadableImage, find_images, jpeg_is_complete, prediction_names,
                                       read_image)

PIXELS = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)


def _jpeg(**params) -> bytes:
    flags = [value for pair in params.items() for value in (getattr(cv2, pair[0]), pair[1])]
    return cv2.imencode(".jpg", PIXELS, flags)[1].tobytes()


def test_grayscale_becomes_three_equal_channels(tmp_path):
    cv2.imwrite(str(tmp_path / "gray.png"), PIXELS[:, :, 0])
    image = read_image(str(tmp_path / "gray.png"))
    assert image.shape == (48, 64, 3) and image.dtype == np.uint8
    for channel in range(3):
        np.testing.assert_array_equal(image[:, :, channel], PIXELS[:, :, 0])


def test_sixteen_bit_is_scaled_to_eight_bits(tmp_path):
    cv2.imwrite(str(tmp_path / "deep.png"), PIXELS.astype(np.uint16) * 257)  # 255 -> 65535: the full 16-bit range
    image = read_image(str(tmp_path / "deep.png"))
    assert image.dtype == np.uint8
    np.testing.assert_array_equal(image, PIXELS)


def test_alpha_is_dropped(tmp_path):
    cv2.imwrite(str(tmp_path / "alpha.png"), np.dstack([PIXELS, np.full((48, 64), 7, np.uint8)]))
    np.testing.assert_array_equal(read_image(str(tmp_path / "alpha.png")), PIXELS)


@pytest.mark.parametrize("name, content, reason", [
    ("empty.jpg", b"", "empty file"),
    ("text.jpg", b"hello, not an image\n", "not an image that OpenCV can decode (it is text)"),
    ("binary.png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "not an image that OpenCV can decode"),
    ("truncated.jpg", _jpeg()[:-200], "truncated JPEG: the data ends before the image does"),
    ("no-end-marker.jpg", _jpeg()[:-2], "truncated JPEG: the data ends before the image does"),
], ids=["empty", "text", "binary", "truncated-jpeg", "jpeg-without-end-marker"])
def test_unreadable_files_say_why(tmp_path, name, content, reason):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UnreadableImage) as error:
        read_image(str(tmp_path / name))
    assert str(error.value) == reason


@pytest.mark.parametrize("params", [{}, {"IMWRITE_JPEG_PROGRESSIVE": 1}, {"IMWRITE_JPEG_RST_INTERVAL": 2}],
                         ids=["baseline", "progressive", "restart-markers"])
def test_jpeg_completeness_follows_the_markers(params):
    content = _jpeg(**params)
    assert jpeg_is_complete(content)
    assert jpeg_is_complete(content + b"\xff\xda trailing data after the end-of-image marker")
    assert not any(jpeg_is_complete(content[:cut]) for cut in range(4, len(content) - 1, 97))


def test_names_keep_the_folders_apart_and_files_are_taken_once(tmp_path):
    for folder in ("a", "b", "a/deeper"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(tmp_path / folder / "x.png"), PIXELS)
    (tmp_path / "a" / "notes.txt").write_text("no image")
    images, ignored = find_images([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "a" / "x.png")])
    assert [image.name for image in images] == ["a/x.png", "b/x.png"] and ignored == 1
    images, _ = find_images([str(tmp_path / "a")], recursive=True)
    assert [image.name for image in images] == ["x.png", "deeper/x.png"]
    (image,), _ = find_images([str(tmp_path / "b" / "x.png")])
    assert image.name == "x.png"


def test_prediction_names_never_collide():
    assert prediction_names(["x.jpg", "sub/x.jpg", "y.png"]) == ["x.json", "sub/x.json", "y.json"]
    assert prediction_names(["x.jpg", "x.png"]) == ["x.jpg.json", "x.png.json"]
    names = ["x.png", "x.jpg", "x.png.jpg"]
    assert len(set(prediction_names(names))) == 3
