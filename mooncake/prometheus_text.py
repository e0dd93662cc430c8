"""What every process's /metrics leaves out of prometheus_client's text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


class WithoutCreated:
    """A registry's families less prometheus_client's `_created` timestamps, which the text format
    shows as extra series beside every counter and histogram (a scrape's worth of noise that no
    rule or panel reads). Turning them off is process-wide (disable_created_metrics) and would
    reach vLLM's own registry in a worker; filtering at render time keeps it to ours."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
