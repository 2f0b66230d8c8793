"""Retention (docs/operations.md, "Retention"): when a job became paused (jobs paused before this
migration count from it, so they keep their checkpoints PAUSED_CHECKPOINT_DAYS from the upgrade), an
index of the ended jobs by finish time for the purge, and the purged jobs' counts for /metrics."""
from django.db import migrations, models
from django.utils import timezone


def paused_from_now(apps, schema_editor):
    apps.get_model("scheduling", "Job").objects.filter(state="paused", paused_at__isnull=True).update(
        paused_at=timezone.now())


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0007_job_params_columns'),
    ]

    operations = [
        migrations.CreateModel(
            name='PurgedJobs',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('model_id', models.CharField(max_length=200)),
                ('state', models.CharField(choices=[('queued', 'Queued'), ('paused', 'Paused'), ('dispatched', 'Dispatched'), ('running', 'Running'), ('succeeded', 'Succeeded'), ('failed', 'Failed'), ('cancelled', 'Cancelled')], max_length=20)),
                ('count', models.PositiveBigIntegerField(default=0)),
            ],
        ),
        migrations.AddField(
            model_name='job',
            name='paused_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(condition=models.Q(('state__in', ('succeeded', 'failed', 'cancelled'))), fields=['finished_at'], name='job_ended_finished'),
        ),
        migrations.AddConstraint(
            model_name='purgedjobs',
            constraint=models.UniqueConstraint(fields=('model_id', 'state'), name='purged_jobs_model_state'),
        ),
        migrations.RunPython(paused_from_now, migrations.RunPython.noop),
    ]
