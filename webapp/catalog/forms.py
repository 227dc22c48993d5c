"""The register-a-model form (staff): a file on the site and the boards (or uploaded), or a Hugging Face folder;
checked by building and cutting the model, as every board will."""

from __future__ import annotations

import hashlib
from pathlib import Path

from django import forms
from django.conf import settings

from engine.errors import UserError
from webapp.catalog.models import LabModel

MAX_UPLOAD = 2 * 1024 * 1024  # a module's source; weights come by path (--init), never through a form


class LabModelForm(forms.Form):
    name = forms.SlugField(max_length=64, help_text="What users pick in the job form: letters, digits, - and _.")
    source = forms.CharField(
        max_length=500, required=False,
        help_text="FILE.py:FUNCTION (a function of no arguments returning an nn.Module) or hf:FOLDER (a Hugging Face "
        "model folder), at a path the site and every board can read.",
    )  # fmt: skip
    upload = forms.FileField(required=False, help_text="Or upload the .py file (then give FUNCTION in Function).")
    function = forms.CharField(max_length=100, required=False, help_text="With an uploaded file: the function.")
    input_shape = forms.CharField(max_length=40, required=False, label="Input shape",
                                  help_text="C,H,W for a module that takes images.")  # fmt: skip
    seq_len = forms.IntegerField(min_value=1, max_value=65536, required=False, label="Sequence length",
                                 help_text="Token ids per sample, for a text model.")  # fmt: skip
    init = forms.CharField(max_length=500, required=False, label="Starting weights",
                           help_text="A .pt or .safetensors state_dict the boards can read (optional).")  # fmt: skip

    def clean_name(self):
        from engine.models import model_names

        name = self.cleaned_data["name"]
        if name in model_names() or LabModel.objects.filter(name=name).exists():
            raise forms.ValidationError(f"{name} is taken (by the zoo or another registered model).")
        return name

    def clean(self):
        data = super().clean()
        upload, source = data.get("upload"), (data.get("source") or "").strip()
        if bool(upload) == bool(source):
            raise forms.ValidationError("Give a source path or upload a file, one of them.")
        if upload:
            if upload.size > MAX_UPLOAD or not upload.name.endswith(".py"):
                raise forms.ValidationError(f"Upload a .py file of at most {MAX_UPLOAD // 1024} KiB.")
            if not (data.get("function") or "").isidentifier():
                raise forms.ValidationError("Name the function of the uploaded file that returns the module.")
            content = upload.read()
            folder = Path(settings.VAR_DIR) / "models"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{hashlib.sha256(content).hexdigest()[:16]}.py"
            path.write_bytes(content)
            source = f"{path}:{data['function']}"
        try:
            data["spec"] = register(source, data.get("input_shape") or None, data.get("seq_len"), data.get("init"))
        except UserError as exc:
            raise forms.ValidationError(str(exc)) from None
        return data


def register(source: str, input_shape: str | None, seq_len: int | None, init: str | None):
    """The pinned reference and the engine's spec of `source`, built and cut as a board will (its starting
    weights checked against it): (reference, spec)."""
    from engine.models import get_model
    from engine.models.source import pinned, reference
    from engine.models.weights import initial_layers

    ref = pinned(reference(source, input_shape, seq_len))
    if len(ref) > LabModel._meta.get_field("reference").max_length:
        raise UserError(f"the path {source.rpartition(':')[0]} is too long to register: move the model nearer the root")
    spec = get_model(ref)
    if init:
        if not Path(init).is_absolute():
            raise UserError(f"starting weights {init}: give an absolute path the boards can read")
        initial_layers(spec, 0, init)
    return ref, spec
