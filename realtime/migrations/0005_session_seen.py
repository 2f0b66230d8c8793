"""Session rows carry when their socket's process last vouched for them (`seen_at`): the sweep closes
rows whose socket is gone (docs/design/shared-admission.md, "The sweep")."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('realtime', '0004_queue_moves'),
    ]

    operations = [
        migrations.AddField(
            model_name='realtimesession',
            name='seen_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
