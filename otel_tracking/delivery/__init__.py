"""Getting OTel data out: the delivery engine (queue, worker, retry, spool), sinks, the JSON codec, the
backend registry, replay. Imports exporters, config, signals.
"""
