"""Tool schemas, their implementations, the toolset registry and the sandboxes they run in."""
