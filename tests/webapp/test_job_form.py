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


@pytest.mark.parametrize("given, expected", [({}, 0), ({"eval_every": ""}, 0), ({"eval_every": 0}, 0),
                                             ({"eval_every": 5}, 5), ({"eval_every": 20}, 20)])  # fmt: skip
def test_evaluation_is_off_unless_asked_for(cluster_c, given, expected):
    form = JobForm({**BODY, "model": "mobilenetv2", "dataset": "digits", "iterations": 20, **given})
    assert form.is_valid(), form.errors
    assert form.cleaned_data["eval_every"] == expected


@pytest.mark.parametrize(
    "given, message",
    [
        ({"eval_every": -1}, "Must be a whole number from 0 to 100000."),
        ({"eval_every": 2.5}, "Must be a whole number from 0 to 100000."),
        ({"eval_every": "often"}, "Must be a whole number from 0 to 100000."),
        ({"eval_every": 21}, "At most the job's 20 iterations (0: never)."),
        ({"eval_every": 5, "batch_size": 1024}, "An evaluation scores at most 512 held-out samples in whole batches"),
    ],
)
def test_a_bad_evaluation_interval_is_a_form_error(cluster_c, given, message):
    form = JobForm({**BODY, "model": "mobilenetv2", "dataset": "synthetic", "iterations": 20, **given})
    assert not form.is_valid()
    assert list(form.errors) == ["eval_every"] and form.errors["eval_every"][0].startswith(message)


def test_the_evaluation_interval_is_checked_against_the_iterations_epochs_make(cluster_c):
    body = {**BODY, "model": "mobilenetv2", "dataset": "digits", "epochs": 1}  # 1438 / 50: 29 iterations
    assert JobForm({**body, "eval_every": 29}).is_valid()
    assert JobForm({**body, "eval_every": 30}).errors["eval_every"] == ["At most the job's 29 iterations (0: never)."]


@pytest.mark.parametrize(
    "given, expected", [({}, "off"), ({"compression": "4"}, "4"), ({"compression": "auto"}, "auto")]
)
def test_compression_is_off_unless_asked_for(cluster_c, given, expected):
    form = JobForm({**BODY, "model": "mobilenetv2", "dataset": "digits", "iterations": 20, **given})
    assert form.is_valid(), form.errors
    assert form.cleaned_data["compression"] == expected


@pytest.mark.parametrize("given, expected", [({}, "auto"), ({"schedule": "zb-h1"}, "zb-h1")])
def test_the_schedule_is_auto_unless_one_is_asked_for(cluster_c, given, expected):
    form = JobForm({**BODY, "model": "mobilenetv2", "dataset": "digits", "iterations": 20, **given})
    assert form.is_valid(), form.errors
    assert form.cleaned_data["schedule"] == expected
    bad = {**BODY, "model": "mobilenetv2", "dataset": "digits", "iterations": 20, "schedule": "gpipe"}
    assert list(JobForm(bad).errors) == ["schedule"]


def test_an_unknown_compression_level_is_a_form_error(cluster_c):
    form = JobForm({**BODY, "model": "mobilenetv2", "dataset": "digits", "iterations": 20, "compression": "3"})
    assert list(form.errors) == ["compression"]


def test_iterations_and_epochs_both_given_is_an_error_naming_both(cluster_c):
    form = JobForm({**BODY, "model": "mobilenetv2", "dataset": "digits", "iterations": 20, "epochs": 2})
    assert not form.is_valid()
    assert form.errors["epochs"] == [
        "Give iterations or epochs, not both (20 iterations and 2 epochs): empty one of them."
    ]


def test_the_form_says_which_boards_are_emulated_and_refuses_a_mix_or_a_device_named_twice(cluster_c):
    from webapp.devices.models import Device

    Device.objects.create(name="board-0", kind="jetson-nano", status=Device.Status.ONLINE, measured={})
    labels = dict(JobForm().fields["devices"].choices)
    assert labels["nx-0"] == "nx-0 (Jetson Xavier NX, emulated, online)"
    assert labels["board-0"] == "board-0 (Jetson Nano, real board, online)"
    base = {**BODY, "model": "mobilenetv2", "dataset": "digits", "iterations": 20}
    form = JobForm({**base, "devices": ["nx-0", "board-0"]})
    assert form.errors["devices"] == [
        "nx-0 is emulated and board-0 is real: they cannot share a run; pick devices of one kind"
    ]
    form = JobForm({**base, "devices": ["nx-0", "nx-0"]})
    assert form.errors["devices"] == ["Each device once: nx-0 named more than once."]
    Device.objects.filter(name="tx2-1").update(status=Device.Status.DISABLED)  # found trying it: planned, then failed
    form = JobForm({**base, "devices": ["nx-0", "tx2-1"]})
    assert form.errors["devices"] == [
        "Not online: tx2-1 (disabled). Untick it; staff enable a disabled or failed device on the devices page."
    ]
    assert JobForm({**base, "devices": ["nx-0", "tx2-0"]}).is_valid()


@pytest.mark.parametrize(
    "model, expected",
    [
        ("gpt-small", {"optimizer": "adamw", "lr": 3e-4, "lr_schedule": "cosine", "warmup": 4, "clip_grad_norm": 1.0}),
        ("bert-small", {"optimizer": "adamw", "weight_decay": 0.01, "warmup": 4}),
        ("mobilenetv2", {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "lr_schedule": "constant", "warmup": 0}),
    ],
)
def test_a_model_brings_its_recipe_where_the_owner_sets_none(cluster_c, model, expected):
    """A transformer trains with AdamW, warm-up and cosine decay (with SGD at 0.05 gpt-small diverged); a CNN with
    SGD and momentum. What the owner sets wins."""
    form = JobForm({"batch_size": 16, "bandwidth_mbps": 1000, "model": model, "dataset": "synthetic",
                    "iterations": 40})  # fmt: skip
    assert form.is_valid(), form.errors
    assert {k: form.cleaned_data[k] for k in expected} == expected
    mine = JobForm({"batch_size": 16, "bandwidth_mbps": 1000, "model": model, "dataset": "synthetic",
                    "iterations": 40, "optimizer": "adam", "lr": 0.01})  # fmt: skip
    assert mine.is_valid() and (mine.cleaned_data["optimizer"], mine.cleaned_data["lr"]) == ("adam", 0.01)
    assert "Empty: the model's, adamw for transformers, sgd for other models." in str(JobForm()["optimizer"].help_text)


def test_a_warmup_past_the_run_or_a_pattern_naming_nothing_is_the_fields_error(cluster_c):
    body = {"batch_size": 16, "bandwidth_mbps": 1000, "model": "gpt-small", "dataset": "synthetic", "iterations": 5}
    form = JobForm({**body, "warmup": 6})
    assert not form.is_valid() and "warm-up must be at most the run's 5 iterations" in form.errors["warmup"][0]
    form = JobForm({**body, "freeze": "^encoder"})
    assert not form.is_valid() and "names no parameter of gpt-small" in form.errors["freeze"][0]
    assert JobForm({**body, "freeze": r"^[0-3]\."}).is_valid()


def test_a_dataset_the_boards_do_not_have_is_refused_before_planning(cluster_c):
    """Issue 52, defect 7: cifar10 without its folder on the boards planned fine and failed only at launch. Each
    agent says which datasets it has (engine.data.datasets_here); the form and the planning believe it."""
    from webapp.devices.models import Device
    from webapp.jobs.planning import pick_devices

    without = ["digits", "pytext", "synthetic"]
    Device.objects.update(measured={"emulated": True, "datasets": without})
    base = {**BODY, "model": "mobilenetv2", "dataset": "cifar10", "iterations": 20}
    form = JobForm(base)
    assert form.errors["dataset"][0].startswith("nano-0, nano-1, nano-2, nx-0, tx2-0, tx2-1 have no cifar10 data: ")
    assert "CIFAR-10's python batch files in their agents' ASTEROID_DATA_DIR" in form.errors["dataset"][0]
    Device.objects.filter(name__in=["nx-0", "tx2-0"]).update(
        measured={"emulated": True, "datasets": [*without, "cifar10"]}
    )
    assert JobForm(base).is_valid()  # planned on the two that have it
    assert {d.name for d in pick_devices([], "cifar10")[0]} == {"nx-0", "tx2-0"}
    form = JobForm({**base, "devices": ["nx-0", "nano-0"]})
    assert form.errors["devices"][0].startswith("nano-0 has no cifar10 data")
    assert JobForm({**base, "dataset": "digits", "devices": ["nx-0", "nano-0"]}).is_valid()


def test_a_job_that_asks_for_cuda_is_planned_only_on_boards_with_a_gpu(cluster_c):
    from engine.errors import UserError
    from webapp.devices.models import Device
    from webapp.jobs.planning import passed_over, pick_devices

    Device.objects.update(measured={"emulated": True, "compute": "cpu"})
    Device.objects.filter(name__in=["nx-0", "tx2-0"]).update(measured={"emulated": True, "compute": "cuda"})
    assert {d.name for d in pick_devices([], compute="cuda")[0]} == {"nx-0", "tx2-0"}
    assert len(pick_devices([], compute="auto")[0]) == 6  # auto: each board where it computes
    with pytest.raises(UserError, match="^nano-0 computes on the CPU .* Compute device is cuda: choose auto"):
        pick_devices(["nx-0", "nano-0"], compute="cuda")
    planned = list(Device.objects.filter(name__in=["nx-0", "tx2-0"]))
    assert (
        passed_over(planned, [], "synthetic", compute="cuda")["nano-1"]
        == "no CUDA GPU: the job's Compute device is cuda"
    )
    Device.objects.update(measured={"emulated": True, "compute": "cpu"})
    with pytest.raises(UserError, match="nano-0, nano-1, nano-2, nx-0, tx2-0, tx2-1 compute on the CPU"):
        pick_devices([], compute="cuda")
    base = {**BODY, "model": "mobilenetv2", "dataset": "synthetic", "iterations": 20}
    form = JobForm({**base, "device": "cuda"})  # the form says it at once, as for a dataset
    assert form.errors["device"][0].startswith("nano-0, nano-1, nano-2, nx-0, tx2-0, tx2-1 compute on the CPU")
    assert JobForm({**base, "device": "auto"}).is_valid()
