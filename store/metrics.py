"""The pool's figures as Prometheus metric families (prometheus_client), for the worker's /metrics.

The shell reads `PoolService.stats()` at scrape time and registers `PoolCollector(stats)` in
that scrape's registry (as mooncake/engine/metrics.py does with the connector's counters), so
the pool keeps plain counters and never a registry of its own.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# PoolService.stats()["counters"] key -> (metric name without _total, help)
COUNTERS = {
    "spills": ("mooncake_store_spills", "Blocks evicted from DRAM and written to the SSD tier."),
    "promotions": ("mooncake_store_promotions", "Blocks read back from the SSD tier into DRAM."),
    "dram_evictions": ("mooncake_store_dram_evictions", "Blocks that left the DRAM tier to make room."),
    "ssd_evictions": ("mooncake_store_ssd_evictions", "Block files deleted to make room on the SSD tier."),
    "corrupt": ("mooncake_store_corrupt_blocks", "Blocks that failed their checksum on the way back from SSD "
                "(a miss: recomputed)."),
    "spill_failures": ("mooncake_store_spill_failures", "Spills that did not reach the disk (the block is lost, "
                       "never served wrong)."),
    "spills_dropped": ("mooncake_store_spills_dropped", "Spills dropped because the disk fell behind."),
    "ssd_errors_full": ("mooncake_store_ssd_full_errors", "Writes that found the SSD tier's disk full (the pool "
                        "turned DRAM-only)."),
    "ssd_errors_unwritable": ("mooncake_store_ssd_unwritable_errors", "The SSD tier's directory could not be used "
                              "(the pool turned DRAM-only)."),
    "ssd_errors_io": ("mooncake_store_ssd_io_errors", "Other read or write errors of the SSD tier."),
    "ssd_skipped_truncated": ("mooncake_store_ssd_truncated_files", "Truncated block files skipped at start-up."),
    "ssd_skipped_foreign": ("mooncake_store_ssd_foreign_files", "Files not of this pool skipped at start-up."),
    "remote_fetched_blocks": ("mooncake_store_remote_fetched_blocks", "Blocks fetched from other nodes' pools."),
    "remote_served_blocks": ("mooncake_store_remote_served_blocks", "Blocks served to other nodes' pools."),
    "remote_corrupt": ("mooncake_store_remote_corrupt_blocks", "Blocks from other nodes that failed their checksum."),
}
USAGE = {
    "capacity_bytes": ("mooncake_store_capacity_bytes", "Capacity of each tier of the KV pool (bytes)."),
    "used_bytes": ("mooncake_store_used_bytes", "Bytes of each tier in use, blocks being written included (bytes)."),
    "blocks": ("mooncake_store_blocks", "Blocks each tier can serve now."),
}


class PoolCollector:
    """One scrape's view of `PoolService.stats()`. Counters absent from the stats are left out
    (never shown as zero, which would read as a reset)."""

    def __init__(self, stats: dict):
        self._stats = stats

    def collect(self):
        usage = self._stats.get("usage", {})
        for field, (name, help_text) in USAGE.items():
            family = GaugeMetricFamily(name, help_text, labels=["tier"])
            for tier, figures in sorted(usage.items()):
                family.add_metric([tier], figures[field])
            yield family
        if "ssd_enabled" in self._stats:
            yield GaugeMetricFamily("mooncake_store_ssd_enabled", "1 while the SSD tier is in use, 0 when the pool "
                                    "runs DRAM-only (none configured, or turned off by a disk fault).",
                                    value=int(bool(self._stats["ssd_enabled"])))
        counters = self._stats.get("counters", {})
        for key, (name, help_text) in COUNTERS.items():
            if key in counters:
                yield CounterMetricFamily(name, help_text, value=counters[key])
