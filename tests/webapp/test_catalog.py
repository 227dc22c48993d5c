"""The lab's own models on the site: staff register a module file (checked by building and cutting it), users pick
it in the job form, a job plans it and carries its pinned reference to the boards, whose copy must match."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.errors import UserError
from engine.models import get_model
from webapp.catalog.models import LabModel
from webapp.jobs.forms import JobForm
from webapp.jobs.models import Job
from webapp.jobs.tasks import plan_job

SOURCE = Path(__file__).parents[1] / "engine" / "usermodels.py"


@pytest.fixture
def staff(client, alice):
    client.force_login(alice)
    return client


def register(client, **fields):
    body = {"name": "lab-unet", "source": f"{SOURCE}:unet", "input_shape": "3,16,16", **fields}
    return client.post("/models/add/", body, follow=True)


def test_staff_register_a_module_file_and_users_see_its_layers(staff, bob, client):
    r = register(staff)
    assert r.status_code == 200
    model = LabModel.objects.get(name="lab-unet")
    assert model.reference.startswith(f"{SOURCE}:unet@image:3,16,16#sha256:") and len(model.digest) == 64
    assert model.layers == ["0:down1", "1:down2", "2:mid", "3:up", "4:out", "5:head"] and model.task == "classification"
    assert "lab-unet is registered: 6 layers, classification." in r.content.decode()
    client.logout()
    client.force_login(bob)
    page = client.get("/models/").content.decode()
    assert "lab-unet" in page and "3:up" in page and "Register a model" not in page  # users read, staff register
    assert client.post("/models/add/", {"name": "x", "source": f"{SOURCE}:vit"}).status_code in (302, 403)
    assert not LabModel.objects.filter(name="x").exists()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"source": f"{SOURCE}:branchy", "input_shape": "4"}, "cannot capture the module&#x27;s graph"),
        ({"source": f"{SOURCE}:resnet", "input_shape": "5,16,16"}, "the module rejects an input of shape"),
        ({"source": "/nowhere/x.py:f"}, "model file /nowhere/x.py does not exist"),
        ({"name": "mobilenetv2"}, "mobilenetv2 is taken"),
        ({"init": "relative.pt"}, "give an absolute path the boards can read"),
    ],
)
def test_a_model_that_cannot_be_used_is_refused_with_the_reason(staff, fields, message):
    r = register(staff, **fields)
    assert r.status_code == 400 and message in r.content.decode()
    assert not LabModel.objects.exists()


def test_a_registered_model_is_picked_in_the_job_form_planned_and_pinned(staff, alice, cluster_c, profile_cache):
    register(staff)
    reference = LabModel.objects.get().reference
    form = JobForm(
        {"model": "lab-unet", "dataset": "synthetic", "batch_size": 16, "iterations": 2, "bandwidth_mbps": 1000}
    )
    assert ("lab-unet", "lab-unet (the lab's: classification)") in form.fields["model"].choices
    assert form.is_valid(), form.errors
    assert form.cleaned_data["model"] == reference  # what the job trains, and what every board checks
    r = staff.post("/api/jobs/", {"model": "lab-unet", "dataset": "synthetic", "batch_size": 16, "iterations": 2},
                   content_type="application/json")  # fmt: skip
    job = Job.objects.get(pk=r.json()["id"])
    assert job.model == reference
    assert plan_job(job.pk) == "planned"
    job.refresh_from_db()
    assert job.plan["model"] == reference
    page = staff.get(f"/jobs/{job.pk}/").content.decode()
    assert "0:down1" in page  # the plan page shows the layers as the graph cut them


def test_a_board_whose_file_differs_refuses_it(tmp_path):
    from engine.models.source import pinned, reference

    copy = tmp_path / "usermodels.py"
    shutil.copy(SOURCE, copy)
    pinned_ref = pinned(reference(f"{copy}:unet", "3,16,16"))
    assert get_model(pinned_ref).task == "classification"
    copy.write_text(copy.read_text() + "\n# edited on this board\n")
    with pytest.raises(UserError, match=r"is not the one planned for: its SHA-256 is [0-9a-f]{12}…, the job's"):
        get_model(pinned_ref)


def test_an_uploaded_module_file_is_kept_by_its_hash_and_registered(staff, settings, tmp_path):
    from django.core.files.uploadedfile import SimpleUploadedFile

    settings.VAR_DIR = tmp_path
    upload = SimpleUploadedFile("nets.py", SOURCE.read_bytes(), content_type="text/x-python")
    r = staff.post("/models/add/", {"name": "lab-resnet", "upload": upload, "function": "resnet",
                                    "input_shape": "3,16,16"}, follow=True)  # fmt: skip
    assert r.status_code == 200, r.content.decode()[-2000:]
    model = LabModel.objects.get(name="lab-resnet")
    kept = Path(model.reference.split(":")[0])
    assert kept.parent == tmp_path / "models" and kept.read_bytes() == SOURCE.read_bytes()


def test_staff_register_a_hugging_face_folder_pinned_by_its_files(staff, tmp_path):
    from transformers import GPT2Config

    GPT2Config(vocab_size=300, n_positions=16, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)  # fmt: skip
    r = register(staff, name="lab-gpt2", source=f"hf:{tmp_path}", input_shape="")
    assert r.status_code == 200, r.content.decode()[-1500:]
    model = LabModel.objects.get(name="lab-gpt2")
    assert model.reference.startswith(f"hf:{tmp_path}@text:16#sha256:")  # its config's positions
    assert model.task == "language-modeling" and len(model.layers) >= 3
    (tmp_path / "config.json").write_text(
        (tmp_path / "config.json").read_text().replace('"n_layer": 1', '"n_layer": 2')
    )
    with pytest.raises(UserError, match="is not the one planned for"):
        get_model(model.reference)
