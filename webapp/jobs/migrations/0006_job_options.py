"""A job's run options move into one JSON field, `Job.options` (engine.runtime.options.settable())."""

from django.db import migrations, models

MOVED = ("lr", "eval_every")  # the run options that had columns of their own


def into_options(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    for job in Job.objects.all():
        job.options = {name: getattr(job, name) for name in MOVED}
        job.save(update_fields=["options"])


def out_of_options(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    for job in Job.objects.all():
        for name in MOVED:
            if name in job.options:
                setattr(job, name, job.options[name])
        job.save(update_fields=list(MOVED))


class Migration(migrations.Migration):
    dependencies = [("jobs", "0005_job_archived")]

    operations = [
        migrations.AddField(model_name="job", name="options", field=models.JSONField(blank=True, default=dict)),
        migrations.RunPython(into_options, out_of_options),
        migrations.RemoveField(model_name="job", name="eval_every"),
        migrations.RemoveField(model_name="job", name="lr"),
    ]
