"""Datasets: CIFAR-10 batch files (written here in the real format), synthetic data, the registry."""

import pickle

import numpy as np
import pytest
import torch
from torch import nn

from engine.data import CIFAR10, SyntheticText, SyntheticVision, dataset_names, get_dataset
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
    assert dataset_names() == ["cifar10", "synthetic"]
    write_cifar(tmp_path / "cifar-10-batches-py")
    assert len(get_dataset("cifar10", get_model("resnet50"), root=tmp_path)) == 20
    with pytest.raises(UserError, match="'resnet50-224'.*dataset 'synthetic'"):
        get_dataset("cifar10", get_model("resnet50-224"), root=tmp_path)
    with pytest.raises(UserError, match="cifar10"):
        get_dataset("cifar10", get_model("gpt-small"), root=tmp_path)
    with pytest.raises(UserError, match="unknown dataset 'imagenet'; known datasets: cifar10, synthetic"):
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
