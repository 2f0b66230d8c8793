"""Jobs' steps, width and height in columns, and their init_images out of the rows into the file
storage (`jobs/<id>/init_image.txt`, the text as submitted): existing rows are carried over in
batches. Reversible: the images go back into the params."""
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import migrations, models

BATCH = 500


def _column(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31 else None


def forwards(apps, schema_editor):
    Job = apps.get_model("scheduling", "Job")
    last = None
    while True:
        rows = Job.objects.order_by("id")
        if last is not None:
            rows = rows.filter(id__gt=last)
        batch = list(rows.only("id", "params")[:BATCH])
        if not batch:
            return
        for job in batch:
            params = job.params if isinstance(job.params, dict) else {}
            job.steps, job.width, job.height = (_column(params.get(name)) for name in ("steps", "width", "height"))
            image = params.pop("init_image", None)
            if isinstance(image, str):
                job.init_image = default_storage.save(f"jobs/{job.id}/init_image.txt",
                                                      ContentFile(image.encode("utf-8")))
            job.params = params
        Job.objects.bulk_update(batch, ["steps", "width", "height", "init_image", "params"])
        last = batch[-1].id


def backwards(apps, schema_editor):
    Job = apps.get_model("scheduling", "Job")
    for job in Job.objects.exclude(init_image="").only("id", "params", "init_image").iterator(chunk_size=BATCH):
        with default_storage.open(job.init_image, "rb") as stored:
            job.params = {**job.params, "init_image": stored.read().decode("utf-8")}
        job.save(update_fields=["params"])


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0006_webhooks'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='height',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='init_image',
            field=models.CharField(blank=True, default='', max_length=300),
        ),
        migrations.AddField(
            model_name='job',
            name='steps',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='width',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.RunPython(forwards, backwards),
    ]
