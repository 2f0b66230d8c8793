"""Webhooks: a job's end POSTed, signed as Standard Webhooks says, to the URL it was submitted with.
addresses.py and policy.py decide (pure), resolving.py and sending.py do the network, services.py the
rows, delivery.py an attempt's steps and runner.py its threads. The story: docs/operations.md."""
