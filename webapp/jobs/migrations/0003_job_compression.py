from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0002_job_eval_every"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="compression",
            field=models.CharField(default="off", max_length=16),
        ),
    ]
