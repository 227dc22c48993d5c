"""The new-job form, shared by the page and the API (and its name, tags and note, also set later): every field
checked with a message that says the fix."""

from __future__ import annotations

import re

from django import forms

from engine.data import PATH_DATASETS, dataset_names, train_size
from engine.devices import LIMITS
from engine.errors import UserError
from engine.models import get_model, model_names
from engine.recipe import RECIPE_OPTIONS, defaults_text, family_defaults
from engine.runtime import options as run_options
from engine.runtime.options import RunOptions, settable
from webapp.catalog.models import LabModel, reference_of
from webapp.devices.models import Device
from webapp.jobs.planning import no_data, no_gpu, unmixed
from webapp.lib.fields import number, whole_number

MAX_BATCH = 4096
MAX_ITERATIONS = 100_000
MAX_DEVICES = 1024
MAX_EPOCHS = 1000  # bounded so that epochs -> iterations stays a finite number (the iteration cap applies after)
EVAL_SAMPLES = RunOptions().eval_samples  # what a job's evaluation scores at most, in whole batches


MAX_TAGS = 12
TAG = re.compile(r"[\w .:/+-]{1,40}")


class LabelForm(forms.Form):
    """What a job is called, its tags and a note: given with the job or later, searched on the jobs list."""

    name = forms.CharField(max_length=120, required=False, help_text="A name to find it by (optional).")
    tags = forms.CharField(max_length=400, required=False, help_text='Comma-separated, e.g. "baseline, lr-sweep".')
    note = forms.CharField(max_length=5000, required=False, widget=forms.Textarea(attrs={"rows": 2}))

    def clean_tags(self) -> str:
        given = [t.strip() for t in self.cleaned_data["tags"].split(",") if t.strip()]
        first: dict[str, str] = {}
        for tag in given:  # "X" and "x" are one tag: the first spelling
            first.setdefault(tag.lower(), tag)
        tags = list(first.values())
        bad = [t for t in tags if not TAG.fullmatch(t)]
        if bad:
            raise forms.ValidationError(
                f"A tag is 1 to 40 letters, digits, spaces or . : / + - _ ({bad[0][:50]!r} is not)."
            )
        if len(tags) > MAX_TAGS:
            raise forms.ValidationError(f"At most {MAX_TAGS} tags ({len(tags)} given).")
        return ", ".join(tags)


class JobForm(LabelForm):
    model = forms.ChoiceField(choices=[])
    dataset = forms.ChoiceField(choices=[], initial="synthetic")
    batch_size = whole_number(1, MAX_BATCH, initial=64)
    iterations = whole_number(1, MAX_ITERATIONS, initial=20, required=False)
    epochs = number(
        0.01,
        MAX_EPOCHS,
        required=False,
        help_text="Instead of iterations: passes over the data's training split. One or the other: typing in one "
        "empties the other, and the API refuses both.",
    )
    bandwidth_mbps = number(0.1, LIMITS["bandwidth_mbps"][1], label="Bandwidth (Mbps)", initial=1000.0)
    compression = forms.ChoiceField(
        choices=[
            ("off", "off (float32)"),
            ("8", "8 bits"),
            ("4", "4 bits"),
            ("2", "2 bits"),
            ("auto", "auto (per boundary, the fastest predicted)"),
            ("delta:4", "4 bits, changes of activations"),
            ("delta:2", "2 bits, changes of activations"),
            ("delta:auto", "auto, changes of activations"),
        ],
        initial="off",
        required=False,
        help_text="Bits per value of the activations and gradients sent between stages. Changes of activations: a "
        "sample seen before sends how its activation changed since it last crossed (AQ-SGD); both ends keep its "
        "last one, which the plan's memory counts.",
    )
    devices = forms.MultipleChoiceField(
        choices=[],
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every online, idle real board, else every emulated one (the two cannot share a run); "
        "when all are busy, the busy ones. A job launched on busy devices waits in line for them.",
    )
    device_group = forms.ChoiceField(
        choices=[], required=False, label="Or a group", help_text="Instead of ticking: the devices of this group."
    )
    device_count = whole_number(
        1, MAX_DEVICES, required=False, label="At most N devices",
        help_text="Instead of ticking: any N of them (of the group, if one is chosen), the fastest idle ones first.",
    )  # fmt: skip

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        lab = [(m.name, f"{m.name} (the lab's: {m.task})") for m in LabModel.objects.all()]
        self.fields["model"].choices = [(m, m) for m in model_names()] + lab
        # the datasets read from a path on the devices are the CLI's: a job has no data folder yet
        self.fields["dataset"].choices = [(d, d) for d in dataset_names() if d not in PATH_DATASETS]
        for name, spec in settable().items():  # the run options, from their declarations
            self.fields[name] = option_field(name, spec)
        self.order_fields(
            ["model", "dataset", "batch_size", "iterations", "epochs", *settable(), "name", "tags", "note"]
        )
        groups = sorted(set(Device.objects.exclude(group="").values_list("group", flat=True)))
        self.fields["device_group"].choices = [("", "any"), *[(g, g) for g in groups]]
        self.fields["devices"].choices = [
            (d.name, f"{d.name} ({d.get_kind_display()}, {'emulated' if d.emulated else 'real board'}, {d.status})")
            for d in Device.objects.all()
        ]

    def clean_compression(self):
        return self.cleaned_data["compression"] or "off"  # left out (an API request): off

    def clean(self):
        data = super().clean()
        brought = set()  # the recipe options left to the model (engine.recipe.family_defaults), once it is known
        for name, spec in settable().items():
            if name in data and data[name] in (None, ""):  # left empty, or out of an API request: the default
                data[name] = spec["default"]
                if name in RECIPE_OPTIONS:
                    brought.add(name)
        model, dataset, size = data.get("model"), data.get("dataset"), None
        if model:  # what the job trains: a registered model's pinned reference, or the zoo's name
            data["model"] = model = reference_of(model)
        spec = None
        if model:
            try:  # a registered model whose file changed since, or is gone
                spec = get_model(model)
            except UserError as exc:
                self.add_error("model", str(exc))
        if spec is not None and dataset:
            try:  # a dataset that cannot serve the model is an error
                size = train_size(dataset, spec)
            except UserError as exc:
                self.add_error("dataset", str(exc))
        if data.get("iterations") is None and data.get("epochs") is None:
            if not {"iterations", "epochs"} & set(self.errors):  # a bad value given already says what is wrong
                self.add_error("iterations", "Give the number of iterations or of epochs.")
        elif data.get("iterations") is not None and data.get("epochs") is not None:
            self.add_error("epochs", f"Give iterations or epochs, not both ({data['iterations']} iterations and "
                                     f"{data['epochs']:g} epochs): empty one of them.")  # fmt: skip
        elif data.get("epochs") is not None and data.get("batch_size") and size:
            # One epoch is a pass over the dataset's training split.
            data["iterations"] = max(1, round(data["epochs"] * size / data["batch_size"]))
        if data.get("iterations") and data["iterations"] > MAX_ITERATIONS:
            self.add_error("epochs", f"That is {data['iterations']} iterations; at most {MAX_ITERATIONS}.")
        every, iterations, batch = data.get("eval_every"), data.get("iterations"), data.get("batch_size")
        if every and iterations and every > iterations:
            self.add_error("eval_every", f"At most the job's {iterations} iterations (0: never).")
        elif every and batch and batch > EVAL_SAMPLES:
            self.add_error(
                "eval_every",
                f"An evaluation scores at most {EVAL_SAMPLES} held-out samples in whole batches: "
                f"use a batch size of at most {EVAL_SAMPLES}, or 0 (never).",
            )
        if spec is not None and data.get("iterations"):
            data.update({k: v for k, v in family_defaults(spec, data["iterations"]).items() if k in brought})
        if data.get("iterations") and not self.errors:  # the options together (a warm-up past the run's end, a
            try:  # pattern that names no weight of the model)
                recipe = run_options.RunOptions(**{n: data[n] for n in settable()}, iterations=data["iterations"])
                if spec is not None and (recipe.freeze or recipe.lora):
                    from engine.recipe import model_layers, prepare

                    prepare(spec, model_layers(spec), recipe)
            except UserError as exc:
                first = str(exc).split(" ")[0].rstrip(":")
                field = {"freeze": "freeze", "warm-up": "warmup", "lora": "lora_targets"}.get(first)
                self.add_error(field, str(exc))
        names = data.get("devices") or []
        if names and (data.get("device_group") or data.get("device_count")):
            self.add_error("devices", "Tick devices, or ask for a group or a number of them, not both.")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            self.add_error("devices", f"Each device once: {', '.join(twice)} named more than once.")
        candidates = Device.objects.filter(name__in=names) if names else Device.objects.all()
        if not names and data.get("device_group"):
            candidates = candidates.filter(group=data["device_group"])
        try:
            unmixed(list(candidates) if names else [])
        except UserError as exc:
            self.add_error("devices", str(exc))
        ready = [d for d in candidates if d.in_service]  # a busy one too: launched, the job waits in line
        out = [d for d in candidates if names and not d.in_service]
        if out and ready:  # (none online at all: said below)
            what = ", ".join(f"{d.name} ({d.status})" for d in out)
            staff = any(d.status != "offline" for d in out)  # disabled or failed: staff enable it
            hint = "; staff enable a disabled or failed device on the devices page" if staff else ""
            self.add_error("devices", f"Not online: {what}. Untick {'them' if len(out) > 1 else 'it'}{hint}.")
        count = data.get("device_count")
        if count and not names and ready and count > len(ready):
            self.add_error(
                "device_count",
                f"At most {len(ready)}: the devices online{' in the group' if data.get('device_group') else ''}.",
            )
        lacking = [d for d in ready if dataset and not d.serves(dataset)]
        if lacking and (names or len(lacking) == len(ready)):  # a job plans only where its data is
            try:
                no_data(lacking, dataset)
            except UserError as exc:
                self.add_error("devices" if names else "dataset", str(exc))
        cpu_only = [d for d in ready if not d.computes(data.get("device") or "auto")]
        if cpu_only and (names or len(cpu_only) == len(ready)):  # cuda: only boards with a GPU run it
            try:
                no_gpu(cpu_only)
            except UserError as exc:
                self.add_error("devices" if names else "device", str(exc))
        if not ready:
            self.add_error(
                "devices" if names else None,
                "None of these devices is online."
                if names
                else "No device is online: start the device agents (make run starts emulated ones).",
            )
        return data


def option_field(name: str, spec: dict) -> forms.Field:
    """A run option's form field from its declaration (engine.runtime.options.option): a bounded number or a
    choice; optional, its default when left empty."""
    sentence = spec["help"][:1].upper() + spec["help"][1:] + "."
    common = {"label": spec["label"], "help_text": sentence, "initial": spec["default"], "required": False}
    if name in RECIPE_OPTIONS:  # empty: the model's (engine.recipe.family_defaults)
        common.update(initial=None, help_text=f"{sentence} Empty: the model's, {defaults_text(name, spec['default'])}.")
    if spec["choices"]:
        empty = [("", "the model's")] if name in RECIPE_OPTIONS else []
        return forms.ChoiceField(choices=[*empty, *spec["choices"]], **common)
    if spec["type"] is str:
        return forms.CharField(max_length=500, strip=False, **common)
    if spec["type"] is bool:
        return forms.BooleanField(**common)
    low, high = spec["low"], spec["high"]
    return whole_number(low, high, **common) if spec["type"] is int else number(low, high, **common)
