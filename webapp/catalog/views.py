"""The registered models: everyone sees the list (what the job form offers); staff register and remove them."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from webapp.accounts.auth import staff_required
from webapp.catalog.forms import LabModelForm
from webapp.catalog.models import LabModel


@login_required
def model_list(request):
    form = LabModelForm() if request.user.is_staff else None
    return render(request, "catalog/list.html", {"models": LabModel.objects.all(), "form": form})


@staff_required
@require_POST
def model_add(request):
    form = LabModelForm(request.POST, request.FILES)
    if not form.is_valid():
        return render(request, "catalog/list.html", {"models": LabModel.objects.all(), "form": form}, status=400)
    reference, spec = form.cleaned_data["spec"]
    if LabModel.objects.filter(reference=reference).exists():
        form.add_error(None, "This exact model is registered already (the same file, function and input).")
        return render(request, "catalog/list.html", {"models": LabModel.objects.all(), "form": form}, status=400)
    model = LabModel.objects.create(
        name=form.cleaned_data["name"], reference=reference, init=form.cleaned_data.get("init") or "",
        layers=[layer_name for layer_name in spec.chain.names], task=spec.task, created_by=request.user,
    )  # fmt: skip
    messages.info(request, f"{model.name} is registered: {len(model.layers)} layers, {spec.task}.")
    return redirect("models")


@staff_required
@require_POST
def model_remove(request, model_id: int):
    model = get_object_or_404(LabModel, pk=model_id)
    model.delete()
    messages.info(request, f"{model.name} is removed (jobs that trained it keep their record).")
    return redirect("models")
