"""The shared admission's queue moves: an index for first fit per model, and (PostgreSQL) the
sequence that numbers each admission's queue changes (docs/design/shared-admission.md)."""
from django.db import migrations, models

MOVES_SEQUENCE = "realtime_queue_moves"


def create_sequence(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"CREATE SEQUENCE IF NOT EXISTS {MOVES_SEQUENCE}")


def drop_sequence(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {MOVES_SEQUENCE}")


class Migration(migrations.Migration):

    dependencies = [
        ('realtime', '0003_session_resume'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='realtimesession',
            index=models.Index(fields=['state', 'model_id', 'joined_at'], name='session_state_model_joined'),
        ),
        migrations.RunPython(create_sequence, drop_sequence),
    ]
