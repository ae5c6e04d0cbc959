"""Runs across processes: propagation, worker runs, Ray helpers, scrape targets. Imports runtime and
below.
"""
