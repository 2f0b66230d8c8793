"""The wire contract as typed values, pure (no Django, no I/O): manifests, rungs, the messages of the
worker and browser sockets both ways, close codes and error codes. The API and the GPU worker
program both import it, so the two ends cannot drift. The whole contract is docs/protocol.md."""
