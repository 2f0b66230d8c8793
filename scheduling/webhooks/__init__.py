"""Webhooks: a job's end POSTed, signed as Standard Webhooks says, to the URL it was submitted with.
addresses.py and policy.py decide (pure), resolving.py and sending.py do the network, services.py
writes the rows, delivery.py runs one pass and runner.py its thread. The story: docs/operations.md."""
