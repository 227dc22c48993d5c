"""Datasets: CIFAR-10 batch files, image folders and text files written here in the real formats, the bundled
digits and Python source, synthetic data, the registry."""

import pickle

import numpy as np
import pytest
import torch
from torch import nn

from engine.data import CIFAR10, ByteWindows, SyntheticText, SyntheticVision, dataset_names, get_dataset, train_size
from engine.data import images as image_data
from engine.data import text as text_data
from engine.data.cifar import MEAN, STD, TEST_FILES, TRAIN_FILES
from engine.errors import UserError
from engine.models import get_model


def write_cifar(folder, per_file=4):
    """Fake CIFAR-10 in the python-pickle format: image k of a file is filled with value k, label k % 10."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in TRAIN_FILES + TEST_FILES:
        data = np.repeat(np.arange(per_file, dtype=np.uint8)[:, None], 3072, axis=1)
        batch = {
            b"batch_label": name.encode(),
            b"labels": [k % 10 for k in range(per_file)],
            b"data": data,
            b"filenames": [b"x.png"] * per_file,
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return folder


@pytest.mark.parametrize("inside", [True, False])
def test_cifar_reads_batches(tmp_path, inside):
    folder = write_cifar(tmp_path / "cifar-10-batches-py" if inside else tmp_path)
    train, test = CIFAR10(tmp_path), CIFAR10(folder, train=False)
    assert (len(train), len(test)) == (20, 4)
    x, y = train[3]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64 and y.item() == 3
    expected = (torch.tensor([3 / 255] * 3) - torch.tensor(MEAN)) / torch.tensor(STD)
    assert torch.allclose(x[:, 5, 7], expected)
    assert torch.allclose(x.std((1, 2)), torch.zeros(3))  # one value per channel
    assert [train[i][1].item() for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_cifar_missing_folder_names_it(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(UserError) as err:
        CIFAR10(missing)
    message = str(err.value)
    assert str(missing) in message and "data_batch_1" in message and "nothing is downloaded" in message
    assert "\n" not in message


def test_cifar_missing_file_is_named(tmp_path):
    folder = write_cifar(tmp_path / "cifar-10-batches-py")
    (folder / "data_batch_3").unlink()
    with pytest.raises(UserError, match="missing data_batch_3;"):
        CIFAR10(tmp_path)
    assert len(CIFAR10(tmp_path, train=False)) == 4


def test_cifar_corrupt_file_is_named(tmp_path):
    folder = write_cifar(tmp_path)
    (folder / "data_batch_2").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="corrupt CIFAR-10 file .*data_batch_2"):
        CIFAR10(tmp_path)


def test_cifar_pickle_cannot_run_code(tmp_path):
    folder = write_cifar(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(UserError, match="test_batch"):
        CIFAR10(tmp_path, train=False)
    assert not marker.exists()


def test_get_dataset(tmp_path):
    assert dataset_names() == ["cifar10", "digits", "images", "pytext", "synthetic", "text"]
    write_cifar(tmp_path / "cifar-10-batches-py")
    assert len(get_dataset("cifar10", get_model("resnet50"), root=tmp_path)) == 20
    with pytest.raises(UserError, match="'resnet50-224'.*dataset 'synthetic'"):
        get_dataset("cifar10", get_model("resnet50-224"), root=tmp_path)
    with pytest.raises(UserError, match="cifar10"):
        get_dataset("cifar10", get_model("gpt-small"), root=tmp_path)
    with pytest.raises(
        UserError, match="unknown dataset 'imagenet'; known datasets: cifar10, digits, images, pytext, synthetic, text$"
    ):
        get_dataset("imagenet", get_model("resnet50"))


@pytest.mark.parametrize("name", ["mobilenetv2", "vgg16-224", "bert-small", "gpt-small"])
def test_synthetic_matches_model(name):
    spec = get_model(name)
    data = get_dataset("synthetic", spec, size=16, seed=3)
    x, y = torch.utils.data.default_collate([data[i] for i in range(4)])
    ex, ey = spec.example_batch(4)
    assert x.shape == ex.shape and x.dtype == ex.dtype and y.shape == ey.shape and y.dtype == ey.dtype
    assert 0 <= y.min() and y.max() < spec.num_classes


def same(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b))


def test_synthetic_vision_deterministic():
    a, b = SyntheticVision(8, (3, 32, 32), 10, seed=1), SyntheticVision(8, (3, 32, 32), 10, seed=1)
    assert all(same(a[i], b[i]) for i in range(8))
    assert not same(a[0], SyntheticVision(8, (3, 32, 32), 10, seed=2)[0])
    test = SyntheticVision(8, (3, 32, 32), 10, seed=1, train=False)
    assert torch.equal(test.prototypes, a.prototypes) and not same(a[0], test[0])


@pytest.mark.parametrize("task", ["language-modeling", "classification"])
def test_synthetic_text_deterministic(task):
    a, b = SyntheticText(8, 16, 50, seed=1, task=task), SyntheticText(8, 16, 50, seed=1, task=task)
    assert all(same(a[i], b[i]) for i in range(8))
    assert not torch.equal(a.tokens, SyntheticText(8, 16, 50, seed=2, task=task).tokens)
    x, y = a[0]
    assert x.shape == (16,) and x.max() < 50
    if task == "language-modeling":
        assert torch.equal(x[1:], y[:-1])
    else:
        assert y.shape == () and 0 <= y < 2


def test_synthetic_text_labels_balanced():
    data = SyntheticText(400, 32, 64, seed=0, task="classification", num_classes=2)
    counts = torch.bincount(data.labels, minlength=2)
    assert counts.min() > 100


def train(model, data, loss_fn, steps=60, batch=32, lr=0.05):
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    while len(losses) < steps:
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


def test_tiny_cnn_learns_synthetic_vision():
    data = SyntheticVision(256, (3, 16, 16), 4, seed=0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 4)
    )
    first, last = train(model, data, nn.functional.cross_entropy, steps=40, lr=0.01)
    assert last < 0.5 * first


def test_tiny_model_learns_synthetic_language():
    vocab = 32
    data = SyntheticText(256, 16, vocab, seed=0)
    model = nn.Sequential(nn.Embedding(vocab, 32), nn.Linear(32, vocab))  # a bigram model suffices for a Markov chain
    first, last = train(model, data, lambda out, y: nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1)))
    assert last < first - 1.0


def test_tiny_model_learns_synthetic_classification():
    vocab = 32

    class MeanEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, 16)
            self.out = nn.Linear(16, 2)

        def forward(self, x):
            return self.out(self.embed(x).mean(1))

    data = SyntheticText(256, 16, vocab, seed=0, task="classification")
    first, last = train(MeanEmbedding(), data, nn.functional.cross_entropy, steps=80)
    assert last < 0.6 * first


def one_line_error(call, *args, **kwargs):
    """The message of the UserError that `call(*args, **kwargs)` raises, checked to be one line."""
    with pytest.raises(UserError) as err:
        call(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def digits():
    spec = get_model("mobilenetv2")
    return get_dataset("digits", spec, seed=1), get_dataset("digits", spec, seed=2, train=False)


def test_digits_are_real_upscaled_and_split(digits):
    train, test = digits
    assert (len(train), len(test)) == (1438, 359) == (train_size("digits", get_model("vgg16")), 359)
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x[0], x[2]) and x.std() > 0.5  # a grey image, repeated
    assert set(train.labels.tolist()) == set(test.labels.tolist()) == set(range(10))
    seen = {img.numpy().tobytes() for img in train.images}  # sklearn's 1,797 digits are all distinct
    assert not seen & {img.numpy().tobytes() for img in test.images} and len(seen) == 1438
    all_pixels = torch.cat([train.images, test.images])
    assert abs(all_pixels.mean()) < 1e-5 and abs(all_pixels.std() - 1) < 1e-5


def test_digits_split_is_fixed_and_fits_224_models(digits):
    train, _ = digits
    again = get_dataset("digits", get_model("resnet50-224"), seed=7)  # another run's seed: the same split
    assert torch.equal(again.images, train.images) and torch.equal(again.labels, train.labels)
    x, y = again[5]
    assert x.shape == (3, 224, 224) and y == train[5][1]


@pytest.mark.parametrize("model", ["gpt-small", "bert-small"])
def test_digits_need_an_image_model(model):
    message = one_line_error(get_dataset, "digits", get_model(model))
    assert message.startswith("dataset 'digits' needs an image model with at least 10 classes")
    assert message.endswith("use mobilenetv2, mobilenetv2-224, resnet50, resnet50-224, vgg16, vgg16-224")
    assert one_line_error(train_size, "digits", get_model(model)) == message


def test_pytext_is_the_stdlib_source_split_by_file():
    spec = get_model("gpt-small")
    train, test = get_dataset("pytext", spec), get_dataset("pytext", spec, train=False)
    assert len(train) == train_size("pytext", spec) > 10_000 and len(test) > 1000
    x, y = train[100]
    assert x.shape == y.shape == (128,) and x.dtype == y.dtype == torch.int64 and torch.equal(x[1:], y[:-1])
    assert int(train.data.max()) < 256 and b"def " in train.data[:100_000].numpy().tobytes()
    files = text_data.stdlib_files()
    assert files == text_data.stdlib_files() and files == sorted(files)
    held_out = text_data.pytext_files(train=False)
    assert held_out == files[9::10] and not set(held_out) & set(text_data.pytext_files())
    assert not {"site-packages", "test"} & {part for f in files for part in f.parts}
    assert sum(f.stat().st_size for f in files[:-1]) < text_data.STDLIB_BYTES
    assert len(test.data) == sum(f.stat().st_size for f in held_out)


@pytest.mark.parametrize("dataset", ["pytext", "text"])
@pytest.mark.parametrize("model", ["bert-small", "mobilenetv2"])
def test_byte_text_needs_a_language_model(tmp_path, dataset, model):
    message = one_line_error(get_dataset, dataset, get_model(model), root=tmp_path / "x.txt")
    assert message.startswith(f"dataset {dataset!r} is byte-level next-token text") and "use gpt-small" in message


def test_byte_windows_target_the_next_byte():
    data = ByteWindows(b"abcdefghij", 3)
    assert len(data) == 3  # abc|def|ghi, with j as the last target
    x, y = data[2]
    assert bytes(x.tolist()) == b"ghi" and bytes(y.tolist()) == b"hij" and x.dtype == torch.int64
    with pytest.raises(IndexError):
        data[3]
    assert len(ByteWindows(b"", 3)) == len(ByteWindows(b"abc", 3)) == 0


def test_text_file_holds_out_its_last_tenth(tmp_path):
    path = tmp_path / "book.txt"
    body = bytes(range(256)) * 8  # 2048 bytes: the last 204 are held out
    path.write_bytes(body)
    spec = get_model("gpt-small")
    train, test = get_dataset("text", spec, root=str(path)), get_dataset("text", spec, root=path, train=False)
    assert (len(train), len(test)) == ((1844 - 1) // 128, (204 - 1) // 128) == (14, 1)
    assert train_size("text", spec, root=path) == 14
    x, y = test[0]
    assert x.tolist() == list(body[1844 : 1844 + 128]) and y.tolist() == list(body[1845 : 1845 + 128])
    assert x.dtype == torch.int64 and x.shape == (128,)


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "dataset 'text' needs a text file: give --data-dir FILE"),
        ("missing", "text file {tmp}/missing.txt not found"),
        ("folder", "text file {tmp} not found (it is a folder)"),
        (b"", "text file {tmp}/t.txt is empty"),
        (b"x" * 1289, "text file {tmp}/t.txt has 1289 bytes; windows of 128 need at least 1290"),
    ],
)
def test_text_file_errors(tmp_path, content, needle):
    root = {None: None, "missing": tmp_path / "missing.txt", "folder": tmp_path}.get(content, tmp_path / "t.txt")
    if isinstance(content, bytes):
        root.write_bytes(content)
    spec = get_model("gpt-small")
    message = one_line_error(get_dataset, "text", spec, root=root)
    assert message.startswith(needle.format(tmp=tmp_path)), message
    assert one_line_error(train_size, "text", spec, root=root) == message
    if content == b"x" * 1289:
        root.write_bytes(b"x" * 1290)
        assert len(get_dataset("text", spec, root=root, train=False)) == 1


COLOURS = {"cat": (255, 0, 0), "dog": (0, 255, 0), "emu": (0, 0, 255)}
COLOURS_01 = ([0.0, 1.0, 0.0], [1.0, 0.0, 0.0])  # green and red in 0..1


def write_images(root, counts=(("cat", 6), ("dog", 5), ("emu", 4))):
    """Solid-colour images of various sizes, one colour per class: PNGs, and a JPEG among the dogs."""
    from PIL import Image

    for name, n in dict(counts).items():
        (root / name).mkdir(parents=True)
        for k in range(n):
            suffix = ".jpg" if (name, k) == ("dog", 1) else ".png"
            Image.new("RGB", (10 + k, 7), COLOURS.get(name, (9, 9, 9))).save(root / name / f"{k:02d}{suffix}")
    return root


def test_images_read_by_class_with_every_fifth_held_out(tmp_path):
    root = write_images(tmp_path / "photos")
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / ".thumbnails").mkdir()
    spec = get_model("mobilenetv2")
    train, test = get_dataset("images", spec, root=root), get_dataset("images", spec, root=str(root), train=False)
    assert (len(train), len(test)) == (13, 2) and train_size("images", spec, root=root) == 13
    assert train.labels.tolist() == [0] * 5 + [1] * 4 + [2] * 4 and test.labels.tolist() == [0, 1]
    x, y = train[6]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64 and y == 1
    green, red = ((torch.tensor(c) - torch.tensor(image_data.MEAN)) / torch.tensor(image_data.STD) for c in COLOURS_01)
    assert torch.allclose(x.mean((1, 2)), green, atol=0.05)  # the JPEG is green within its compression
    assert torch.allclose(test[0][0].mean((1, 2)), red) and torch.allclose(test[0][0].std((1, 2)), torch.zeros(3))
    held_out = [path.name for path, _ in image_data.split(image_data.class_files(root, spec), train=False)]
    assert held_out == ["04.png", "04.png"]
    assert get_dataset("images", get_model("vgg16-224"), root=root)[0][0].shape == (3, 224, 224)


def test_unreadable_image_is_named(tmp_path):
    root = write_images(tmp_path)
    (root / "dog" / "02.png").write_bytes(b"\x89PNG but not really")
    message = one_line_error(get_dataset, "images", get_model("mobilenetv2"), root=root)
    assert message.startswith(f"unreadable image {root}/dog/02.png: UnidentifiedImageError")
    assert train_size("images", get_model("mobilenetv2"), root=root) == 13  # counting does not decode


@pytest.mark.parametrize(
    "layout, needle",
    [
        (None, "dataset 'images' needs a folder: give --data-dir DIR"),
        ("missing", "image folder {tmp}/missing not found"),
        ("file", "image folder {tmp}/f.png not found (it is a file)"),
        ({}, "image folder {tmp} has no images: put PNG/JPEG files in one sub-folder per class"),
        ({"cat": 3, "dog": 0}, "class folder(s) dog in {tmp} hold no PNG/JPEG images"),
        ({"cat": 3}, "image folder {tmp} has one class (cat): give at least 2 class sub-folders"),
        (
            {f"c{k:02d}": 1 for k in range(11)},
            "image folder {tmp} has 11 classes but 'mobilenetv2' has 10 outputs: "
            "use mobilenetv2-224, resnet50-224, vgg16-224",
        ),  # fmt: skip
    ],
)
def test_image_folder_errors(tmp_path, layout, needle):
    root = tmp_path
    if isinstance(layout, dict):
        write_images(root, layout)
    else:
        root = {None: None, "missing": tmp_path / "missing", "file": tmp_path / "f.png"}[layout]
        if layout == "file":
            root.write_bytes(b"")
    spec = get_model("mobilenetv2")
    message = one_line_error(get_dataset, "images", spec, root=root)
    assert message.startswith(needle.format(tmp=tmp_path)), message
    assert one_line_error(train_size, "images", spec, root=root) == message


def test_image_folder_needs_held_out_images_and_an_image_model(tmp_path):
    root = write_images(tmp_path, {"cat": 4, "dog": 4})
    assert len(get_dataset("images", get_model("mobilenetv2"), root=root)) == 8
    message = one_line_error(get_dataset, "images", get_model("mobilenetv2"), root=root, train=False)
    assert message.startswith(f"image folder {root} has no held-out images: every 5th image")
    message = one_line_error(get_dataset, "images", get_model("gpt-small"), root=root)
    assert message.startswith("dataset 'images' needs an image model with at least 2 classes")


def test_a_host_serves_cifar10_only_when_its_files_are_there(tmp_path):
    from engine.data import datasets_here

    assert datasets_here(tmp_path) == ["digits", "pytext", "synthetic"]  # (images, text: a CLI run's own path)
    write_cifar(tmp_path / "cifar-10-batches-py")
    assert datasets_here(tmp_path) == ["cifar10", "digits", "pytext", "synthetic"]
