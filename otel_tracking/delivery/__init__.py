"""Getting OTel data out: the delivery engine (a queue and its thread, retry, spool), sinks, the JSON codec, the
backend registry, replay. Imports exporters, config, signals.
"""
