"""The new-job form: its datasets come from the engine, which says which fit the model and how long an epoch is."""

import pytest

from engine.data import dataset_names, train_size
from engine.models import get_model
from webapp.jobs.forms import JobForm

BODY = {"batch_size": 50, "lr": 0.05, "bandwidth_mbps": 1000}


def test_every_engine_dataset_that_needs_no_path_on_the_devices_is_offered(cluster_c):
    offered = [value for value, _ in JobForm().fields["dataset"].choices]
    assert offered == [d for d in dataset_names() if d not in ("images", "text")]
    assert {"cifar10", "digits", "pytext", "synthetic"} <= set(offered)


@pytest.mark.parametrize(
    "model, dataset, size",
    [("mobilenetv2", "cifar10", 50_000), ("mobilenetv2", "synthetic", 2048), ("vgg16-224", "digits", 1438)],
)
def test_epochs_are_passes_over_the_training_split(cluster_c, model, dataset, size):
    form = JobForm({**BODY, "model": model, "dataset": dataset, "epochs": 2})
    assert form.is_valid(), form.errors
    assert form.cleaned_data["iterations"] == round(2 * size / 50)


def test_pytext_epoch_is_its_window_count(cluster_c):
    form = JobForm({**BODY, "model": "gpt-small", "dataset": "pytext", "epochs": 0.5})
    assert form.is_valid(), form.errors
    assert form.cleaned_data["iterations"] == round(0.5 * train_size("pytext", get_model("gpt-small")) / 50)


@pytest.mark.parametrize(
    "model, dataset, message",
    [
        ("bert-small", "digits", "dataset 'digits' needs an image model with at least 10 classes"),
        ("mobilenetv2", "pytext", "dataset 'pytext' is byte-level next-token text for a language model"),
        ("mobilenetv2", "images", "Select a valid choice"),  # a job has no data folder: the CLI's only
        ("gpt-small", "text", "Select a valid choice"),
    ],
)
def test_a_dataset_that_cannot_serve_the_model_is_a_form_error(cluster_c, model, dataset, message):
    form = JobForm({**BODY, "model": model, "dataset": dataset, "epochs": 1})
    assert not form.is_valid()
    assert form.errors["dataset"][0].startswith(message) and "iterations" not in form.errors
